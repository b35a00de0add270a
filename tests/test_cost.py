"""Cost model v0: per-node FLOPs and bytes from fake tensors, summed per graph."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

import zeroc


def _forward_graph_cost(fn, *inputs):
    compiled = torch.compile(fn, backend="zeroc", options={"fusion": False})
    with torch.no_grad():
        compiled(*inputs)
    return zeroc.explain(compiled)


def test_matmul_flops_match_flop_counter() -> None:
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    plan = _forward_graph_cost(lambda x, y: x @ y, a, b)
    with FlopCounterMode(display=False) as counter:
        a @ b
    graph = plan.graphs[0]
    assert graph.flops == counter.get_total_flops() == 2 * 8 * 16 * 4
    mm = [c for c in graph.node_costs if "mm" in c.target]
    assert len(mm) == 1 and mm[0].bytes == (8 * 16 + 16 * 4 + 8 * 4) * 4


def test_pointwise_and_reduction_counts() -> None:
    x = torch.randn(4, 10)
    plan = _forward_graph_cost(lambda t: (t * 2).sum(dim=-1), x)
    costs = {c.target.split(".")[1]: c for c in plan.graphs[0].node_costs}
    assert costs["mul"].flops == 40 and costs["mul"].bytes == 40 * 4 * 2
    assert costs["sum"].flops == 40 and costs["sum"].bytes == (40 + 4) * 4
    assert plan.graphs[0].flops == 80


def test_views_move_no_bytes_and_sums_are_per_graph() -> None:
    x = torch.randn(6, 4)
    plan = _forward_graph_cost(lambda t: t.view(24).exp().view(4, 6).t().contiguous(), x)
    graph = plan.graphs[0]
    views = [c for c in graph.node_costs if c.target.startswith(("aten.view", "aten.t"))]
    assert views and all(c.bytes == 0 and c.flops == 0 for c in views)
    assert graph.flops == sum(c.flops for c in graph.node_costs)
    assert graph.bytes == sum(c.bytes for c in graph.node_costs)
    assert "FLOPs" in str(plan)
