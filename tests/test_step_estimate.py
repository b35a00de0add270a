"""The step-time model inside one graph: a collective hides behind the compute between the
node that issues it and the node that waits for it, and only the rest is exposed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zeroc.runtime.cost.hardware import estimate_collective_s, estimate_compute_s, get_profile
from zeroc.world.step_estimate import _graph_timeline_s

PROFILE = get_profile({"base": "h100-sxm", "intra_node_bytes_per_s": 1e9,
                       "intra_node_latency_s": 1e-9})
MATMUL = 2 * 4096 ** 3  # FLOPs of one node: about 2.8 ms on the profile's fp32 peak


def _graph(*names: str) -> SimpleNamespace:
    return SimpleNamespace(node_costs=tuple(
        SimpleNamespace(name=n, flops=MATMUL if n.startswith("mm") else 0, bytes=0)
        for n in names), flops=0, bytes=0)


def _gather(issued_at: str, waited_at: str, nbytes: int) -> SimpleNamespace:
    return SimpleNamespace(name=f"gather@{issued_at}", op="all_gather", bytes=nbytes,
                           issued_at=issued_at, waited_at=waited_at, graph="g0.forward")


def test_a_gather_issued_early_hides_behind_the_compute_before_its_wait() -> None:
    mm = estimate_compute_s(MATMUL, 0, "float32", PROFILE)
    graph = _graph("ag", "mm1", "mm2", "wait", "mm3")
    small = 2 * int(mm * 1e9)  # takes about as long as two matmuls on the 1 GB/s link
    gather = estimate_collective_s("all_gather", small, 2, PROFILE, False)
    compute, total = _graph_timeline_s(graph, [_gather("ag", "wait", small)], "float32",
                                       PROFILE, 2, False)
    assert compute == pytest.approx(3 * mm)
    assert total == pytest.approx(max(2 * mm, gather) + mm)  # hidden up to the wait
    # Waited at once: nothing to hide behind, the whole gather is exposed.
    _, exposed = _graph_timeline_s(_graph("ag", "wait", "mm1", "mm2", "mm3"),
                                   [_gather("ag", "wait", small)], "float32", PROFILE, 2, False)
    assert exposed == pytest.approx(3 * mm + gather)
    # Two gathers share the one communication stream: the second starts after the first.
    both = [_gather("ag", "wait", small), _gather("mm1", "wait", small)]
    _, serial = _graph_timeline_s(graph, both, "float32", PROFILE, 2, False)
    assert serial == pytest.approx(max(2 * mm, 2 * gather) + mm)


def test_a_collective_outside_the_graphs_nodes_is_waited_at_the_end() -> None:
    mm = estimate_compute_s(MATMUL, 0, "float32", PROFILE)
    loose = _gather("elsewhere", "nowhere", 10 ** 9)  # 1 s on the 1 GB/s link
    compute, total = _graph_timeline_s(_graph("mm1"), [loose], "float32", PROFILE, 2, False)
    assert compute == pytest.approx(mm)
    assert total == pytest.approx(estimate_collective_s("all_gather", 10 ** 9, 2, PROFILE,
                                                        False))


def test_adamw_on_a_cpu_pays_the_launch_floor_per_parameter_tensor() -> None:
    from zeroc.world.step_estimate import ADAMW_OPS_PER_TENSOR, _optimizer_s

    plan = SimpleNamespace(pipeline=None, params=[object()] * 50)
    gpu = get_profile("h100-sxm")
    cpu = get_profile({"base": "h100-sxm", "name": "cpu-test", "launch_floor_s": 5e-6})
    streaming = 10 ** 6 * 28 / gpu.memory_bytes_per_s  # 1M fp32 elements, 28 bytes each
    assert _optimizer_s(plan, 0, 4 * 10 ** 6, gpu) == pytest.approx(streaming)
    assert _optimizer_s(plan, 0, 4 * 10 ** 6, cpu) == pytest.approx(
        streaming + 50 * ADAMW_OPS_PER_TENSOR * 5e-6)


def test_every_graph_of_a_model_with_a_graph_break_counts() -> None:
    """A graph break splits the step into several forward and backward graphs: the step's
    compute is all of them, not the last of each kind."""
    import torch

    from zeroc.world.world_plan import plan_world

    class Broken(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x):
            hidden = torch.relu(self.first(x))
            torch._dynamo.graph_break()
            return self.second(hidden).square().mean()

    plan = plan_world(Broken(), (torch.randn(32, 64),), world=2, zero=0, device="cuda",
                      hardware="h100-sxm")
    kinds = {g.name: g.kind for g in plan.graphs}
    timed = [(kinds.get(name), seconds) for name, seconds in plan.estimate.graphs]
    assert sum(1 for kind, _ in timed if kind == "forward") == 2
    compute = sum(s for kind, s in timed if kind in ("forward", "backward"))
    assert plan.estimate.compute_s == pytest.approx(compute)
    assert plan.estimate.step_s >= compute + plan.estimate.exposed_communication_s
