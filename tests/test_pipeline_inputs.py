"""The batch a pipeline's ranks pass, checked before the step's first transfer
(``zeroc.runtime.pipeline.inputs``) and compared by its bit patterns after it.

Ranks of one pipeline given batches of different shapes used to abort in gloo (the stages'
transfers had different sizes) instead of raising the documented error; identical batches
holding NaN were reported as different ("rank 0 and rank 0 differ"). Now a shape or dtype
difference raises on every rank, naming both ranks and the input, before anything moves; a
NaN trains as eager does. An input that is not batch-shaped but has as many rows as the batch
is named when cutting it fails, and trains as eager does when passed whole
(``options={"unsplit_inputs": [...]}``).
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import run_ranks
from models.gpt import GPT, GPTConfig
from models.mlp import MLP, MLPConfig

import zeroc


def _gpt_batch() -> tuple[torch.Tensor, torch.Tensor]:
    cfg = GPTConfig.tiny()
    tokens = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1),
                           generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _mismatch(rank: int, change) -> str:
    """One step on equal batches, then one where rank 1's batch is ``change``d: the error."""
    torch._dynamo.reset()
    model = zeroc.parallelize(GPT(GPTConfig.tiny(), seed=5), zero=0, pp=2)
    compiled = torch.compile(model, backend="zeroc", options={"microbatches": 2})
    idx, targets = _gpt_batch()
    compiled(idx, targets).backward()
    if rank == 1:
        idx, targets = change(idx, targets)
    try:
        compiled(idx, targets).backward()
    except ValueError as error:
        return str(error)
    return ""


def _nan_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(4))
    x[3, 5] = math.nan
    return x, torch.randn(8, 8, generator=torch.Generator().manual_seed(5))


def _nan_steps() -> list[float]:
    torch._dynamo.reset()
    model = zeroc.parallelize(MLP(MLPConfig(n_layer=2), seed=2), zero=0, pp=2)
    compiled = torch.compile(model, backend="zeroc",
                             options={"microbatches": 2, "loss_reduction": "mean"})
    x, y = _nan_batch()
    losses = []
    for _ in range(2):  # the second call reads the first call's digests
        loss = compiled(x, y)
        loss.backward()
        losses.append(float(loss))
    finite = compiled(x.nan_to_num(), y)  # and a third reads the second's
    losses.append(float(finite))
    return losses


class Projected(torch.nn.Module):
    """Takes a (features, features) matrix beside the batch: 8 rows, as many as the batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor, proj: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x)) @ proj
        return (x - y).square().sum()


def _projected_batch() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(7)
    return tuple(torch.randn(8, 8, generator=generator) for _ in range(3))


def _projected(options: dict) -> dict:
    torch._dynamo.reset()
    model = zeroc.parallelize(Projected(), zero=0, pp=2)
    compiled = torch.compile(model, backend="zeroc", options={"microbatches": 2, **options})
    try:
        loss = compiled(*_projected_batch())
    except ValueError as error:
        return {"error": str(error)}
    loss.backward()
    return {"loss": float(loss.detach()),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None}}


def inputs_job(rank: int, world: int) -> dict:
    return {
        "cut": _projected({}),
        "unsplit": _projected({"unsplit_inputs": ["proj"]}),
        "shape": _mismatch(rank, lambda idx, t: (idx[:, :8].contiguous(), t[:, :8].contiguous())),
        "dtype": _mismatch(rank, lambda idx, t: (idx.int(), t)),
        "nan": _nan_steps(),
    }


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pipeline_inputs_are_checked_before_any_transfer_and_nan_is_not_a_difference() -> None:
    results = run_ranks(inputs_job, 2, timeout=360)
    for result in results:
        assert ("input 'idx' is int64 [8, 16] on rank 0 and int64 [8, 8] on rank 1"
                in result["shape"]), result["shape"]
        assert "checked before the step moves anything" in result["shape"]
        assert "input 'idx' is int64 [8, 16] on rank 0 and int32 [8, 16] on rank 1" in (
            result["dtype"]), result["dtype"]
        assert ("tensor input whose dimension 0 is the batch is cut into micro-batches: "
                "['proj', 'x', 'y']" in result["cut"]["error"]), result["cut"]
        assert "options={'unsplit_inputs': ['name']}" in result["cut"]["error"]
    eager_projected = Projected()
    expected = eager_projected(*_projected_batch())
    expected.backward()
    grads = {**results[0]["unsplit"]["grads"], **results[1]["unsplit"]["grads"]}
    assert sorted(grads) == sorted(n for n, _ in eager_projected.named_parameters())
    for name, param in eager_projected.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6)
    for result in results:
        torch.testing.assert_close(result["unsplit"]["loss"], float(expected), rtol=1e-5, atol=0)
    eager = MLP(MLPConfig(n_layer=2), seed=2)
    x, y = _nan_batch()
    assert math.isnan(float(eager(x, y).detach()))
    for result in results:
        assert all(math.isnan(v) for v in result["nan"][:2]), result["nan"]
        assert math.isfinite(result["nan"][2])
