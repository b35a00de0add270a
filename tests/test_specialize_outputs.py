"""A dynamic graph's static copy at a call's sizes without running it (``specialize_outputs``).

A planned world reads only the structure of the full-batch graph and what it returns, so
``zeroc.pipeline.pipeline_front`` takes this copy instead of ``specialize``'s (which runs every
node on
fake tensors). Its outputs must have the shapes and dtypes ``specialize`` gives them, its
other nodes no example value (none left over from the symbolic graph), and a planned world
must be the same plan either way, for every loss reduction the pipeline proves.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from models.gpt import GPT, GPTConfig
from test_pipeline_losses import IGNORE, WithLoss, batch
from torch import nn

import zeroc
import zeroc.passes.front.specialize_shapes as specialize_shapes
from zeroc.passes.front.specialize_shapes import OUTPUTS_ONLY, outputs_only_copy, specialized_copy
from zeroc.world import plan_workers


class Reshaping(nn.Module):
    """Outputs whose sizes are products and sums of the batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor, labels: torch.Tensor):
        hidden = self.proj(x)  # (B, T, 6)
        flat = hidden.reshape(-1, 6)  # (B*T, 6)
        doubled = torch.cat([flat, flat])  # (2*B*T, 6)
        loss = F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE)
        return loss, doubled.to(torch.bfloat16), x.shape[0] * 3


def _dynamic_graph(model: nn.Module, *inputs: torch.Tensor):
    captured = {}

    def backend(gm, example_inputs):
        captured.setdefault("graph", (gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    for value in inputs:
        torch._dynamo.mark_dynamic(value, 0)
    torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    torch._dynamo.reset()
    return captured["graph"]


def test_outputs_have_specializes_shapes_and_nothing_else_has_a_value() -> None:
    x, labels = torch.randn(4, 5, 8), torch.randint(0, 6, (4, 5))
    gm, symbolic = _dynamic_graph(Reshaping(), x, labels)
    # The call at another batch size: the symbols bind to 7.
    x7, labels7 = torch.randn(7, 5, 8), torch.randint(0, 6, (7, 5))
    inputs = [x7 if v is x else labels7 if v is labels else 7 if isinstance(v, torch.SymInt)
              else v for v in symbolic]
    full = specialized_copy(gm, inputs)
    quick = outputs_only_copy(gm, inputs)
    assert quick is not None and quick.meta[OUTPUTS_ONLY]

    def returned(graph):
        output = next(n for n in graph.graph.nodes if n.op == "output")
        return [a.meta["example_value"] if isinstance(a, torch.fx.Node) else a
                for a in torch.utils._pytree.tree_flatten(output.args[0])[0]]

    expected, got = returned(full), returned(quick)
    assert len(got) == len(expected) == 3
    for want, have in zip(expected, got, strict=True):
        if isinstance(want, torch.Tensor):
            assert (tuple(have.shape), have.dtype) == (tuple(want.shape), want.dtype)
        else:
            assert have == want == 21
    assert tuple(got[1].shape) == (70, 6)
    outputs = set(next(n for n in quick.graph.nodes if n.op == "output").all_input_nodes)
    assert all("example_value" not in n.meta for n in quick.graph.nodes if n not in outputs)
    assert [n.op for n in quick.graph.nodes] == [n.op for n in full.graph.nodes]
    assert [str(n.target) for n in quick.graph.nodes] == [str(n.target) for n in full.graph.nodes]


def _planned(kind: str):
    idx, targets = batch()
    return zeroc.explain(WithLoss(kind), (idx, targets), world=4, pp=2, zero=3, device="cpu",
                         options={"schedule": "1f1b", "microbatches": 4})


@pytest.mark.parametrize("kind", ["sum", "token_mean", "mse_mean", "masked"])
def test_a_planned_world_is_the_same_with_the_full_batch_graph_run(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_workers, "planning_cores", lambda: 1)
    copies = []

    def spy(gm, inputs):
        copies.append(outputs_only_copy(gm, inputs))
        return copies[-1]

    monkeypatch.setattr(specialize_shapes, "outputs_only_copy", spy)
    quick = _planned(kind)
    assert copies and all(c is not None for c in copies)  # the front took the quick copy
    monkeypatch.setattr(specialize_shapes, "outputs_only_copy", lambda gm, inputs: None)
    full = _planned(kind)
    # The same plan but the rows of the full-batch graph's passes (``g0.front``), which
    # record what ran: the quick copy skips the loss normalization's rewrite there.
    assert [p.pass_name for p in full.passes_for("g0.front")] == [
        "specialize_outputs", "keep_loss_output", "normalize_loss"]
    assert [p.pass_name for p in quick.passes_for("g0.front")] == [
        "specialize_outputs", "keep_loss_output"]
    assert _without_front_rows(quick).to_json() == _without_front_rows(full).to_json()
    assert quick.memory and quick.collectives


def _without_front_rows(plan: zeroc.Plan) -> zeroc.Plan:
    return dataclasses.replace(plan, passes=tuple(p for p in plan.passes
                                                  if p.graph != "g0.front"))


def test_a_planned_loss_whose_reduction_cannot_be_proved_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(plan_workers, "planning_cores", lambda: 1)
    with pytest.raises(ValueError, match="cannot tell how the loss is reduced .*square"):
        _planned("unprovable")


def test_a_model_returning_its_logits_too_is_planned_with_full_batch_others() -> None:
    model = GPT(GPTConfig.tiny(), seed=2)  # returns (logits, loss) with targets
    idx, targets = batch()
    plan = zeroc.explain(model, (idx, targets), world=2, pp=2, zero=3, device="cpu",
                         options={"schedule": "1f1b", "microbatches": 4})
    assert len(plan.memory) == 2


def test_repeated_nodes_are_costed_once_at_the_same_cost(monkeypatch) -> None:
    """``specialize(costs=True)`` meters a node once per target and argument metadata: the
    GPT's repeated blocks reuse the first block's costs, which equal metering every node."""
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, d_model=32))
    tokens = torch.zeros(4, 16, dtype=torch.long)
    gm, symbolic = _dynamic_graph(model, tokens, tokens.clone())
    inputs = [torch.zeros(2, 16, dtype=torch.long) if isinstance(v, torch.Tensor)
              and v.dtype == torch.long else 2 if isinstance(v, torch.SymInt) else v
              for v in symbolic]
    metered = []

    class Counting(specialize_shapes.CostMode):
        def __enter__(self):
            metered.append(self)
            return super().__enter__()

    def costs(graph):
        return [(n.name, n.meta[specialize_shapes.SPECIALIZED_RUN].cost)
                for n in graph.graph.nodes if specialize_shapes.SPECIALIZED_RUN in n.meta]

    monkeypatch.setattr(specialize_shapes, "CostMode", Counting)
    reused = costs(specialized_copy(gm, inputs, costs=True))
    reused_meters = len(metered)
    metered.clear()
    monkeypatch.setattr(specialize_shapes, "_cost_key", lambda *a: None)
    every = costs(specialized_copy(gm, inputs, costs=True))
    assert reused == every and len(metered) == len(every)
    assert reused_meters < len(every) * 0.6  # blocks 2 and 3 reuse block 1's costs
