"""The Plan: printed tables, exact JSON round trip, pass provenance, explain's errors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.testing import FileCheck

import zeroc


class TwoLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(F.gelu(self.norm(self.fc1(x)))), y)


def _compiled_plan(options: dict | None = None) -> tuple[torch.nn.Module, zeroc.Plan]:
    torch.manual_seed(0)
    model = TwoLayer()
    compiled = torch.compile(model, backend="zeroc", options=options)
    loss = compiled(torch.randn(4, 16), torch.randint(0, 8, (4,)))
    loss.backward()
    return compiled, zeroc.explain(compiled)


def test_plan_text_has_every_section() -> None:
    _, plan = _compiled_plan()
    text = str(plan)
    (FileCheck()
     .check("zeroc plan").check("torch").check("options:")
     .check("graphs:").check("g0.joint").check("g0.forward").check("g0.backward")
     .check("stages:").check("fc1, norm, fc2")
     .check("parameters (6 tensors").check("fc1.weight").check("32x16")
     .check("kernels (").check("collectives: none")
     .check("estimated memory per rank").check("passes:").check("fusion")
     .run(text))


def test_json_round_trip_is_exact() -> None:
    _, plan = _compiled_plan()
    again = zeroc.Plan.from_json(plan.to_json())
    assert again == plan
    assert again.digest() == plan.digest()
    assert str(again) == str(plan)
    assert isinstance(again.graphs[0].node_costs, tuple)


def test_each_pass_graph_before_and_after_is_reachable() -> None:
    torch._dynamo.reset()
    _, plan = _compiled_plan({"record_graphs": True})
    records = plan.passes_for("g0.forward")
    names = [r.pass_name for r in records]
    assert names == ["lower_zero", "remove_noop_views", "eliminate_dead_code", "fusion"]
    for record in records:
        assert "def forward" in record.before and "def forward" in record.after
    for earlier, later in zip(records, records[1:], strict=False):
        assert later.before == earlier.after
    assert records[0].before != "" and plan.graph("g0.forward").code == records[-1].after
    assert "fused" in records[-1].after and "fused" not in records[-1].before


def test_pass_graph_texts_are_made_only_when_asked_for() -> None:
    torch._dynamo.reset()
    _, plan = _compiled_plan()
    records = plan.passes_for("g0.forward")
    assert records and all(r.before == "" and r.after == "" for r in records)
    assert all(r.nodes_before > 0 for r in records)  # the counts and stats stay
    assert "def forward" in plan.graph("g0.forward").code


def test_parameters_and_memory_estimate() -> None:
    _, plan = _compiled_plan()
    numel = 16 * 32 + 32 + 32 + 32 + 32 * 8 + 8
    assert sum(p.numel for p in plan.params) == numel
    memory = plan.memory[0]
    assert memory.params == numel * 4 and memory.optimizer == 2 * numel * 4
    assert memory.peak >= memory.params + memory.grads + memory.optimizer + memory.activations


def test_explain_rejects_what_zeroc_did_not_compile() -> None:
    model = TwoLayer()
    for thing, pattern in [
        (model, "was not compiled by zeroc"),
        (torch.compile(model, backend="aot_eager"), "not compiled by zeroc|backend='aot_eager'"),
        (torch.compile(model, backend="zeroc"), "call the compiled model once"),
    ]:
        try:
            zeroc.explain(thing)
        except ValueError as error:
            import re

            assert re.search(pattern, str(error)), str(error)
        else:
            raise AssertionError(f"explain({type(thing).__name__}) did not raise")


def test_graph_breaks_and_recompiles_each_appear() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = torch.sin(x) + 1
        torch._dynamo.graph_break()
        return torch.cos(y) * 2

    compiled = torch.compile(fn, backend="zeroc")
    compiled(torch.randn(3))
    plan = zeroc.explain(compiled)
    assert {g.name for g in plan.graphs} >= {"g0.inference", "g1.inference"}


def test_a_graph_module_makes_its_code_when_it_runs_not_at_each_recompile() -> None:
    """``passes.base.graph_module``: recompiling after a rewrite makes no code; running it
    (or reading its code) does, from the graph as it is then."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    from zeroc.passes.base import graph_module, graph_text

    traced = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    gm = graph_module(traced, traced.graph)
    relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
    relu.target = torch.sigmoid  # a pass's rewrite
    gm.recompile()
    assert type(gm)._needs_recompile()  # no code made yet
    assert "sigmoid" in graph_text(gm)  # the text is printed from the graph
    x = torch.randn(5)
    torch.testing.assert_close(gm(x), torch.sigmoid(x) + 1)
    assert isinstance(gm, _LazyGraphModule) and not type(gm)._needs_recompile()
