"""A planned world's positions share one Dynamo trace, one front and identical stages.

``zeroc.explain(model, inputs, world=...)`` traces the model once (``zeroc.world.plan_capture``),
splits it once (``zeroc.pipeline.pipeline_front``) and compiles each distinct stage once
(``zeroc.pipeline.stage_reuse``). Each position's plan must be what planning it alone gives: the
same
graphs (names, kinds and code), passes, kernels, collectives, saved bytes and memory row.

The case is DualPipeV at pp=3 (six one-block stages, three positions): alike stages are
shared across positions (stages 1-4 on positions 1 and 2, 1F1B's case of one stage per
position) and within one (each position runs two chunks of the V), and position 0 holds the
first and the last stage. 1F1B at pp=4 adds no sharing this case lacks and was dropped.
"""

from __future__ import annotations

import pytest
import torch
from models.gpt import GPT, GPTConfig

import zeroc
import zeroc.world.plan_workers as plan_workers
import zeroc.world.world_plan as world_plan
from zeroc.pipeline import stage_trace


def _model(layers: int) -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, d_model=32),
               seed=1)


def _summary(position) -> dict:
    plan = position.plan
    return {
        "graphs": [(g.name, g.kind, g.code) for g in plan.graphs],
        "passes": [(p.pass_name, p.graph, p.changed) for p in plan.passes],
        "kernels": [(k.name, k.graph, k.source_hash) for k in plan.kernels],
        "collectives": sorted((c.name, c.graph, c.op, c.bytes) for c in plan.collectives),
        "saved": [g.peak_bytes for g in plan.graphs],
        "memory": position.memory,
    }


def _plan(monkeypatch: pytest.MonkeyPatch, share: bool) -> tuple[list, int]:
    positions, exports = [], []
    plan_position = world_plan.plan_position

    def spy(*args, **kwargs):
        positions.append(plan_position(*args, **kwargs))
        return positions[-1]

    export = stage_trace.aot_export_joint_simple

    def count(*args, **kwargs):
        exports.append(kwargs.get("trace_joint"))
        return export(*args, **kwargs)

    with monkeypatch.context() as patch:
        # Every position in this process, where the spies see it (no helper process).
        patch.setattr(plan_workers, "planning_cores", lambda: 1)
        patch.setattr(world_plan, "plan_position", spy)
        patch.setattr(stage_trace, "aot_export_joint_simple", count)
        if not share:  # each position on its own, as a separate process would plan it
            patch.setattr(world_plan, "SharedTrace", lambda shared: None)
            patch.setattr(world_plan, "SharedPlanning", lambda: None)
        tokens = torch.zeros(12, 16, dtype=torch.long)
        # One block per stage (Dynamo's trace grows with the blocks): DualPipeV runs 2 * pp.
        zeroc.explain(_model(6), (tokens, tokens), world=6, pp=3, zero=3, device="cpu",
                      options={"schedule": "dualpipev", "microbatches": 6})
    return [_summary(p) for p in positions], sum(1 for e in exports if e)


def test_each_position_plans_as_it_would_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    shared, shared_exports = _plan(monkeypatch, True)
    alone, alone_exports = _plan(monkeypatch, False)
    assert len(shared) == len(alone) == 3
    for position, (mine, want) in enumerate(zip(shared, alone, strict=True)):
        for key in want:
            assert mine[key] == want[key], (position, key)
    # 6 stages, the 4 middle ones alike (first, middle and last compiled once each).
    assert alone_exports == 6
    assert shared_exports == 3


class _BreaksTheGraph(torch.nn.Module):
    """Two blocks with a graph break between them: a pipeline needs one graph."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        torch._dynamo.graph_break()
        return self.second(hidden).sum()


@pytest.mark.parametrize("share", [True, False])
def test_a_graph_break_is_reported_as_a_compile_reports_it(
        share: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared trace refuses a graph break (fullgraph); the position's own trace then
    gives the pipeline's error, naming the break, exactly as planning without sharing."""
    with monkeypatch.context() as patch:
        if not share:
            patch.setattr(world_plan, "SharedTrace", lambda shared: None)
        with pytest.raises(ValueError, match=r"the whole forward must be one graph"):
            zeroc.explain(_BreaksTheGraph(), (torch.ones(4, 8),), world=2, pp=2, zero=0,
                          device="cpu", options={"schedule": "1f1b", "microbatches": 2})
