"""Pipelined losses equal eager on the global batch: sums, means, token means, a user's own.

The zoo GPT returns logits; a wrapper computes the loss as a user would. On 2 gloo ranks
(pp=2, 1F1B, 4 micro-batches) the pipelined loss and every gradient must equal single-process
eager on the global batch, including when the micro-batches hold different numbers of
non-ignored targets. A loss whose reduction cannot be proved is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_harness import RankError, run_ranks
from models.gpt import GPT, GPTConfig
from parity import assert_gradients_match, gradients, merge_held
from torch import nn

import zeroc

BATCH = 8
IGNORE = -100


class WithLoss(nn.Module):
    """The zoo GPT (no targets: logits) followed by the loss ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.gpt = GPT(GPTConfig.tiny(), seed=5)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(idx).flatten(0, 1)
        targets = targets.flatten()
        if self.kind == "sum":
            return F.cross_entropy(logits, targets, reduction="sum")
        if self.kind == "token_mean":
            return F.cross_entropy(logits, targets, ignore_index=IGNORE)
        if self.kind == "mse_mean":
            return (logits.softmax(-1)[:, :4] - 0.25).square().mean()
        if self.kind == "masked":  # a user's own token mean
            mask = (targets != IGNORE).float()
            per_token = F.cross_entropy(logits, targets.clamp(min=0), reduction="none")
            return (per_token * mask).sum() / mask.sum()
        if self.kind == "unprovable":
            return F.cross_entropy(logits, targets.clamp(min=0)).square()
        raise AssertionError(self.kind)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    cfg = GPTConfig.tiny()
    generator = torch.Generator().manual_seed(3)
    idx = torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size), generator=generator)
    targets = torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size), generator=generator)
    # Uneven ignored targets: micro-batch k (2 rows) ignores a different share of its tokens.
    for row in range(BATCH):
        targets[row, : (row * 3) % cfg.block_size] = IGNORE
    return idx, targets


def pipeline_job(rank: int, world: int, kind: str) -> dict:
    model = zeroc.parallelize(WithLoss(kind), zero=0, pp=2)
    compiled = torch.compile(model, backend="zeroc",
                             options={"schedule": "1f1b", "microbatches": 4})
    loss = compiled(*batch())
    loss.backward()
    return {"loss": loss.item(),
            "grads": gradients(model)}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", ["sum", "token_mean", "mse_mean", "masked"])
def test_pipelined_loss_and_gradients_equal_eager(kind: str) -> None:
    results = run_ranks(pipeline_job, 2, kind, timeout=300)
    eager = WithLoss(kind)
    loss = eager(*batch())
    loss.backward()
    for result in results:
        torch.testing.assert_close(torch.tensor(result["loss"]), loss.detach(), rtol=1e-5,
                                   atol=0)
    # Every parameter got its gradient on some rank, and none eager leaves without one.
    assert_gradients_match(gradients(eager), merge_held([r["grads"] for r in results]), kind)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_loss_whose_reduction_cannot_be_proved_is_refused() -> None:
    with pytest.raises(RankError, match=r"cannot tell how the loss is reduced over the batch "
                                        r"\(the loss is computed by square\).*loss_reduction"):
        run_ranks(pipeline_job, 2, "unprovable", timeout=200)


def batch_sizes_job(rank: int, world: int) -> dict:
    from models.gpt import GPT

    model = zeroc.parallelize(GPT(GPTConfig.tiny(), seed=5), zero=0, pp=2)
    compiled = torch.compile(model, backend="zeroc",
                             options={"schedule": "1f1b", "microbatches": 2})
    out: dict = {"losses": [], "grads": []}
    for size in (8, 4, 6):  # a short last batch, then another size
        idx, targets = batch()
        loss = compiled(idx[:size], targets[:size].clamp(min=0))
        loss.backward()
        out["losses"].append(loss.item())
        out["grads"].append(gradients(model))
        model.zero_grad()
    strict = torch.compile(zeroc.parallelize(GPT(GPTConfig.tiny(), seed=5), zero=0, pp=2),
                           backend="zeroc", options={"schedule": "1f1b", "microbatches": 4})
    idx, targets = batch()
    strict(idx, targets.clamp(min=0))
    try:
        strict(idx[:6], targets[:6].clamp(min=0))
    except ValueError as error:
        out["error"] = str(error)
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_changing_batch_size_recompiles_or_says_what_divides_what() -> None:
    from models.gpt import GPT

    results = run_ranks(batch_sizes_job, 2, timeout=300)
    eager = GPT(GPTConfig.tiny(), seed=5)
    for step, size in enumerate((8, 4, 6)):
        idx, targets = batch()
        loss = eager(idx[:size], targets[:size].clamp(min=0))
        loss.backward()
        for result in results:
            torch.testing.assert_close(torch.tensor(result["losses"][step]), loss.detach(),
                                       rtol=1e-5, atol=0)
        assert_gradients_match(gradients(eager), merge_held([r["grads"][step] for r in results]),
                               f"batch of {size}")
        eager.zero_grad()
    assert "microbatches=4 does not divide the batch of 6" in results[0]["error"]


def mismatched_batch_job(rank: int, world: int) -> dict:
    from models.gpt import GPT

    model = zeroc.parallelize(GPT(GPTConfig.tiny(), seed=5), zero=0, pp=2)
    compiled = torch.compile(model, backend="zeroc", options={"microbatches": 2})
    idx, targets = batch()
    out = {"dp": (zeroc.data_parallel_rank(model), zeroc.data_parallel_size(model))}
    compiled(idx, targets.clamp(min=0))  # the same batch everywhere: fine
    # A per-global-rank sampler: each rank of the pipeline gets other rows. The batches are
    # compared when the next call ends (no step waits for the device to read them).
    compiled(idx.roll(rank, 0), targets.clamp(min=0))
    try:
        compiled(idx, targets.clamp(min=0))
    except ValueError as error:
        out["error"] = str(error)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_of_a_pipeline_given_different_batches_all_raise() -> None:
    results = run_ranks(mismatched_batch_job, 2, timeout=240)
    for result in results:
        assert result["dp"] == (0, 1)
        assert "in the previous call (rank 0 and rank 1 differ" in result["error"]
        assert "zeroc.data_parallel_rank(model)" in result["error"]


def evaluation_job(rank: int, world: int) -> dict:
    from models.gpt import GPT

    model = zeroc.parallelize(GPT(GPTConfig.tiny(), seed=5), zero=3, pp=2)
    compiled = torch.compile(model, backend="zeroc",
                             options={"microbatches": 2, "fused_loss": True})
    idx, targets = batch()
    compiled(idx, targets.clamp(min=0)).backward()
    from zeroc.runtime.pipeline.executor import PipelineExecutor

    ran = []
    for name in ("_backward", "_weight"):
        original = getattr(PipelineExecutor, name)
        setattr(PipelineExecutor, name,
                lambda self, *a, _o=original, _n=name, **k: (ran.append(_n), _o(self, *a, **k)))
    with torch.no_grad():
        loss = compiled(idx, targets.clamp(min=0))
    plan = zeroc.explain(compiled)
    inference = [g for g in plan.graphs if g.kind == "inference"]
    return {"loss": loss.item(), "backwards": ran, "inference": [g.name for g in inference],
            "need_grad": ["True" in g.code.split("linear_cross_entropy")[-1].split(")")[0]
                          for g in inference if "linear_cross_entropy" in g.code]}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_evaluation_runs_forward_only_stage_graphs() -> None:
    from models.gpt import GPT

    results = run_ranks(evaluation_job, 2, timeout=240)
    idx, targets = batch()
    expected = GPT(GPTConfig.tiny(), seed=5)(idx, targets.clamp(min=0)).item()
    for result in results:
        assert result["backwards"] == []
        assert result["loss"] == pytest.approx(expected, rel=1e-5)
        assert len(result["inference"]) == 1 and result["inference"][0].endswith("inference")
    assert results[1]["need_grad"] == [False]  # the head's fused loss computes no gradients
