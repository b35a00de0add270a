"""A parameter eager would give a gradient and the compiled program would not is a compile
error (``zeroc.frontend.grad_coverage``), at pp=1, under ZeRO-3 and in pipelines.

The model adds a per-expert bias in place to a routed projection (``out.add_(bias[ids])``,
the way Hugging Face's grouped MoE experts add theirs) and reads one parameter only under
``no_grad`` (eager leaves its ``.grad`` None: the guard must not flag it). Two plants make a
compiled program lose a gradient: a Dynamo-graph pass that detaches a parameter's read, and
the pipeline's dead-code clean-up without its in-place rule (the bug that left GPT-OSS's
expert biases without gradients at pp=2). Each must raise ``MissingGradientError`` naming the
parameter and the graph or stage; unplanted, the compiled gradients equal eager's, set and
values.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from torch import nn

import zeroc
from zeroc.frontend.grad_coverage import MissingGradientError
from zeroc.passes.base import PassResult

DIM, EXPERTS, BATCH = 8, 4, 8


class RoutedBlock(nn.Module):
    """A top-1 routed projection with per-expert biases added in place."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.weight = nn.Parameter(torch.randn(EXPERTS, DIM, DIM) / DIM ** 0.5)
        self.bias = nn.Parameter(torch.randn(EXPERTS, DIM))
        self.scale = nn.Parameter(torch.ones(DIM))  # read only under no_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)
        gate, ids = probs.max(-1)
        out = torch.einsum("bd,bdk->bk", x, self.weight[ids])
        out.add_(self.bias[ids])
        with torch.no_grad():
            gain = self.scale.mean()
        return x + out * gain * gate[:, None]


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(RoutedBlock() for _ in range(2))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return ((self.head(h) - y) ** 2).mean()


def _model() -> Routed:
    torch.manual_seed(0)
    return Routed()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, DIM, generator=generator),
            torch.randn(BATCH, DIM, generator=generator))


def _detach_reads_of(param: str):
    """A Dynamo-graph pass that cuts the gradient path of the parameter named ``param``."""
    from zeroc.frontend.capture import source_name

    def detach_reads(gm: torch.fx.GraphModule, ctx) -> PassResult:
        changed = False
        for node in list(gm.graph.nodes):
            if node.op == "placeholder" and source_name(node) == param:
                with gm.graph.inserting_after(node):
                    cut = gm.graph.call_method("detach", (node,))
                node.replace_all_uses_with(cut, delete_user_cb=lambda user, c=cut: user is not c)
                changed = True
        gm.recompile()
        return PassResult(gm, changed)

    return detach_reads


def _plant_detach(fragment: str) -> None:
    import zeroc.frontend.capture

    capture = zeroc.frontend.capture
    capture.DYNAMO_PASSES = (*capture.DYNAMO_PASSES, _detach_reads_of(fragment))


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    def full(g):
        return None if g is None else (g.full_tensor() if hasattr(g, "full_tensor") else g)

    return {n: full(p.grad) for n, p in model.named_parameters()}


def _eager_grads() -> dict[str, torch.Tensor | None]:
    model = _model()
    model(*_batch()).backward()
    return _grads(model)


def test_unplanted_gradients_equal_eager_including_the_unused_one() -> None:
    model = _model()
    torch.compile(model, backend="zeroc")(*_batch()).backward()
    eager, compiled = _eager_grads(), _grads(model)
    assert {n for n, g in compiled.items() if g is None} == {"layers.0.scale", "layers.1.scale"}
    assert {n for n, g in compiled.items() if g is None} == {
        n for n, g in eager.items() if g is None}
    for name, grad in eager.items():
        if grad is not None:
            torch.testing.assert_close(compiled[name], grad, rtol=1e-5, atol=1e-6)


def test_a_gradient_cut_by_a_pass_raises_naming_parameter_and_graph(monkeypatch) -> None:
    import zeroc.frontend.capture

    monkeypatch.setattr(zeroc.frontend.capture, "DYNAMO_PASSES",
                        (*zeroc.frontend.capture.DYNAMO_PASSES, _detach_reads_of("layers.1.bias")))
    with pytest.raises(MissingGradientError, match=r"layers\.1\.bias \(graph g0\)"):
        torch.compile(_model(), backend="zeroc")(*_batch())


def guard_job(rank: int, world: int) -> dict:
    out = {}
    x, y = _batch()
    # Unplanted pipeline: every gradient eager has, on the rank holding the stage.
    torch._dynamo.reset()
    model = zeroc.parallelize(_model(), zero=0, pp=world)
    torch.compile(model, backend="zeroc", options={"microbatches": 4})(x, y).backward()
    out["pp"] = {n: g for n, g in _grads(model).items() if g is not None and g.numel()}
    # Planted: the pipeline's dead-code clean-up forgets that add_ writes in place.
    import zeroc.passes.front.loss_normalization as normalization

    kept = normalization.has_effect
    normalization.has_effect = lambda node: node.is_impure()
    torch._dynamo.reset()
    model = zeroc.parallelize(_model(), zero=0, pp=world)
    try:
        torch.compile(model, backend="zeroc", options={"microbatches": 4})(x, y)
        out["pp_planted"] = "compiled"
    except MissingGradientError as error:
        out["pp_planted"] = str(error)
    normalization.has_effect = kept
    # Planted at pp=1 under ZeRO-3: a read of layers.0.weight detached.
    _plant_detach("layers.0.weight")
    torch._dynamo.reset()
    model = zeroc.parallelize(_model(), zero=3)
    half = BATCH // world
    try:
        torch.compile(model, backend="zeroc")(x[rank * half:(rank + 1) * half],
                                              y[rank * half:(rank + 1) * half])
        out["zero3_planted"] = "compiled"
    except MissingGradientError as error:
        out["zero3_planted"] = str(error)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pipeline_and_zero3_guard() -> None:
    ranks = run_ranks(guard_job, 2, timeout=500)
    eager = _eager_grads()
    held = {**ranks[0]["pp"], **ranks[1]["pp"]}
    assert set(held) == {n for n, g in eager.items() if g is not None}
    for name, grad in held.items():
        torch.testing.assert_close(grad, eager[name], rtol=1e-5, atol=1e-6)
    for rank in ranks:
        assert "layers.0.bias (read by no pipeline stage)" in rank["pp_planted"]
        assert "layers.1.bias (read by no pipeline stage)" in rank["pp_planted"]
        assert "layers.0.weight (graph g0)" in rank["zero3_planted"]
