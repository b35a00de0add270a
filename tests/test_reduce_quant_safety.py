"""Quantized reductions are safe (``reduce_quant``, ``zeroc.runtime.quant.reduce``).

- A NaN or infinite gradient element never enters the error-feedback residual: that step's
  reduced element is NaN, the block's others are quantized as if it were zero, and the next
  clean step is what it would be had that element's residual been reset (the op, and a
  2-rank ZeRO-2 and ZeRO-3 GPT with one NaN injected on one rank at one step).
- Residuals belong to the model: a recompile for a new batch shape reuses them, a new model
  starts empty, and a model that is gone leaves nothing held.
- ``zeroc.ReductionResiduals(model)`` in the checkpoint makes a resume exact: a fresh 2-rank
  job that loads step 4 and trains to step 6 ends with the uninterrupted run's parameters,
  bit for bit (without the residuals it does not).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from dist_harness import run_ranks
from models.gpt import GPT, GPTConfig

import zeroc
from zeroc.runtime.quant import reduce as reduce_quant
from zeroc.runtime.quant.gather import BLOCK
from zeroc.runtime.quant.reduce import DEQUANTIZE_SUM_MEAN, QUANTIZE_GRAD_ROWS, store_of
from zeroc.world.host_syncs import count_host_syncs

STEPS, BAD, SAVE = 6, 2, 4  # the NaN at step BAD; the checkpoint before step SAVE
SEQ = 12  # positions SEQ..15 of pos_emb get no gradient: one of them is poisoned
POISONED = (14, 3)
OPTIONS = {"reduce_quant": "int8"}


def rows_sent(packed: torch.Tensor, ranks: int, width: int, bits: int) -> torch.Tensor:
    """What each quantized row stands for: rank r's row alone, dequantized (float32)."""
    return torch.stack([DEQUANTIZE_SUM_MEAN(packed.view(ranks, -1)[r].repeat(1), packed, 1,
                                            width, bits, BLOCK, torch.float32)
                        for r in range(ranks)])


@pytest.mark.parametrize("bits", [8, 4])
def test_a_non_finite_element_never_enters_the_residual(bits: int) -> None:
    """NaN, +inf and -inf in three blocks: the residual stays finite (zero there), the
    reduced elements are NaN and only they, and the rest is what a step sends, and keeps,
    whose bad elements are zero and start from a zero residual (so the next clean step
    sends the same)."""
    generator = torch.Generator().manual_seed(bits)
    width = 3 * BLOCK
    bad = (5, BLOCK + 7, 2 * width - 1)
    steps = [torch.randn(2 * width, generator=generator) for _ in range(3)]
    zeroed = steps[1].clone()
    poisoned = steps[1].clone()
    for index, value in zip(bad, (float("nan"), float("inf"), float("-inf")), strict=True):
        zeroed[index], poisoned[index] = 0.0, value

    def run(middle: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        reduce_quant.reset_residuals()
        sent = [QUANTIZE_GRAD_ROWS(steps[0], 2, bits, BLOCK, "safety")]
        residuals = reduce_quant._UNOWNED.residuals
        if middle is zeroed:  # the reference: those elements' residual reset, then zero
            residuals["safety"].view(-1)[list(bad)] = 0.0
        sent.append(QUANTIZE_GRAD_ROWS(middle, 2, bits, BLOCK, "safety"))
        residual = residuals["safety"].clone()
        sent.append(QUANTIZE_GRAD_ROWS(steps[2], 2, bits, BLOCK, "safety"))
        return sent, residual

    with count_host_syncs("cpu") as syncs:  # no value read: the CUDA path stays async
        (_, bad_step, after_bad), residual = run(poisoned)
        mean = DEQUANTIZE_SUM_MEAN(bad_step, bad_step, 2, width, bits, BLOCK, torch.float32)
    assert not syncs, syncs
    (_, zero_step, after_zero), reference = run(zeroed)
    reduce_quant.reset_residuals()
    assert bool(residual.isfinite().all()) and torch.equal(residual, reference)
    got, want = rows_sent(bad_step, 2, width, bits), rows_sent(zero_step, 2, width, bits)
    nan = torch.zeros(2 * width, dtype=torch.bool)
    nan[list(bad)] = True
    assert torch.equal(got.isnan().view(-1), nan)
    assert torch.equal(got.view(-1)[~nan], want.view(-1)[~nan])
    assert torch.equal(mean.isnan(), nan.view(2, width).any(0))  # an exact mean is non-finite
    assert torch.equal(after_bad, after_zero)


def test_residuals_are_held_by_their_owner() -> None:
    """The op keeps a residual in the store its key names: a store lives as long as its
    owner (a model's ZeroState), and a key of a store that is gone keeps nothing."""

    class Owner:
        pass

    first, second = Owner(), Owner()
    rows = torch.randn(2 * BLOCK)
    for owner in (first, second):
        QUANTIZE_GRAD_ROWS(rows, 2, 8, BLOCK, store_of(owner).key("bucket"))
    assert store_of(first) is not store_of(second)
    assert len(store_of(first)) == len(store_of(second)) == 1
    token, gone = store_of(first).token, weakref.ref(store_of(first))
    del first
    gc.collect()
    assert gone() is None
    held = reduce_quant.residuals_held()
    QUANTIZE_GRAD_ROWS(rows, 2, 8, BLOCK, f"{token}/bucket")  # its model is gone: not kept
    assert reduce_quant.residuals_held() == held and len(store_of(second)) == 1


class Probed(GPT):
    """The zoo GPT whose loss adds ``(pos_emb.weight * poison).sum()``: ``poison`` is added to
    the position embedding's gradient (all zero: the GPT's own loss and gradients)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor,
                poison: torch.Tensor) -> torch.Tensor:
        return super().forward(idx, targets) + (self.pos_emb.weight * poison).sum()


def _batch(step: int, rank: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (2, seq + 1), generator=torch.Generator().manual_seed(
        100 * step + rank))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def _model(zero: int) -> tuple[torch.nn.Module, object, torch.optim.Optimizer]:
    model = zeroc.parallelize(Probed(GPTConfig.tiny(), seed=3), zero=zero)
    compiled = torch.compile(model, backend="zeroc", options=OPTIONS, dynamic=False)
    return model, compiled, torch.optim.SGD(model.parameters(), lr=0.5)


def _train(rank: int, run: tuple, steps: range, poison_at: int = -1,
           save: str | None = None) -> dict:
    """Train ``run`` (model, compiled, optimizer) over ``steps``; step BAD's update is
    skipped (its gradients are not finite when poisoned, as a GradScaler would)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model, compiled, optimizer = run
    losses, finite = [], []
    for step in steps:
        if step == SAVE and save is not None:
            zeroc.save_checkpoint({"model": get_model_state_dict(model),
                                   "residuals": zeroc.ReductionResiduals(model)}, save)
        poison = torch.zeros(16, 32)
        if step == poison_at and rank == 0:
            poison[POISONED] = float("nan")
        loss = compiled(*_batch(step, rank), poison)
        loss.backward()
        bad = torch.tensor([float(not all(bool(_local(p.grad).isfinite().all())
                                          for p in model.parameters() if p.grad is not None))])
        dist.all_reduce(bad)
        finite.append(bad.item() == 0)
        if step != BAD:
            optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "finite": finite,
            "params": {k: _local(v).detach().clone() for k, v in model.state_dict().items()}}


def train_job(rank: int, world: int, directory: str) -> dict:
    results = {}
    for zero in (2, 3):
        poisoned = _model(zero)
        results[("poisoned", zero)] = _train(rank, poisoned, range(STEPS), poison_at=BAD)
        results[("clean", zero)] = _train(rank, _model(zero), range(STEPS),
                                          save=directory if zero == 2 else None)
    # Ownership: a recompile for a new batch shape reduces the same buckets of the same model.
    model, compiled, _ = poisoned
    residuals = zeroc.ReductionResiduals(model)
    before = (len(residuals), residuals.nbytes, reduce_quant.residuals_held())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled(*_batch(0, rank, seq=8), torch.zeros(16, 32)).backward()
    results["recompiled"] = (before, (len(residuals), residuals.nbytes,
                                      reduce_quant.residuals_held()),
                             torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs)
    fresh = _model(3)
    results["fresh_empty"] = len(zeroc.ReductionResiduals(fresh[0]))
    return results


def resume_job(rank: int, world: int, directory: str) -> dict:
    """Two fresh models load the checkpoint of step SAVE, with and without the residuals,
    and train on to STEPS."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    results = {}
    for residuals in (True, False):
        run = _model(2)
        state = {"model": get_model_state_dict(run[0])}
        if residuals:
            state["residuals"] = zeroc.ReductionResiduals(run[0])
        zeroc.load_checkpoint(state, directory)
        set_model_state_dict(run[0], state["model"])
        results[residuals] = _train(rank, run, range(SAVE, STEPS))
    return results


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[list[dict], str]:
    directory = str(tmp_path_factory.mktemp("residuals") / "ckpt")
    return run_ranks(train_job, 2, directory, timeout=300), directory


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("zero", [2, 3])
def test_one_nan_gradient_does_not_poison_later_steps(trained, zero: int) -> None:
    """A NaN in one gradient element on rank 0 at step BAD: that step's reduced gradients
    are not finite (its update is skipped), and every later step is the clean run's (whose
    step BAD was skipped too), losses and parameters bit for bit."""
    for rank, result in enumerate(trained[0]):
        poisoned, clean = result[("poisoned", zero)], result[("clean", zero)]
        assert poisoned["finite"] == [step != BAD for step in range(STEPS)], rank
        assert all(clean["finite"]), rank
        later = poisoned["losses"][BAD + 1:]
        assert all(torch.isfinite(torch.tensor(later))) and later == clean["losses"][BAD + 1:]
        for key, value in clean["params"].items():
            assert torch.equal(poisoned["params"][key], value), (rank, key)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_residuals_belong_to_the_model(trained) -> None:
    """A recompile for a new batch shape holds no more residuals (its graphs name the same
    buckets of the same model); a new model's store starts empty."""
    for result in trained[0]:
        (count, nbytes, held), after, recompiles = result["recompiled"]
        assert count > 0 and nbytes > 0 and recompiles == 1
        assert after == (count, nbytes, held)
        assert result["fresh_empty"] == 0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_resume_with_the_residuals_is_exact(trained) -> None:
    """A fresh job loads step SAVE and trains on: with ``ReductionResiduals`` in the
    checkpoint it ends where the uninterrupted run ended, bit for bit; without, it does
    not (the residuals matter)."""
    results, directory = trained
    resumed = run_ranks(resume_job, 2, directory, timeout=300)
    for rank, (got, whole) in enumerate(zip(resumed, results, strict=True)):
        want = whole[("clean", 2)]
        assert got[True]["losses"] == want["losses"][SAVE:], rank
        for key, value in want["params"].items():
            assert torch.equal(got[True]["params"][key], value), (rank, key)
        assert any(not torch.equal(got[False]["params"][k], v)
                   for k, v in want["params"].items()), rank
