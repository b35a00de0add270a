"""Gradient accumulation and clipping in pipelines (pp=2) against single-process eager.

A pipelined step runs every micro-batch's forward and backward inside the compiled call, so
the backward the user seeds afterwards only scales what the step kept. Here each case
accumulates 2 and then 4 micro-steps, the first ones without gradient synchronisation
(``model.set_requires_gradient_sync(False)`` or ``zeroc.no_sync(model)``), each scaled
before ``backward()`` (``(loss / k).backward()`` or ``loss.backward(gradient=...)``, a
different factor per micro-step). Every gradient a rank holds (the set of parameters with a
gradient, too) must equal eager's on the same global batches, at dp 1 and 2, ZeRO 0 and 3,
1F1B and DualPipeV, and with ``pp_reshard=True``. Then ``torch.nn.utils.clip_grad_norm_``
and ``torch.nn.utils.get_total_norm`` on ``model.parameters()`` must return eager's norm
(every pipeline position's gradients, the tied embedding counted once) and clip alike.

All cases of one world size run in one job (one process start, Dynamo reset per model).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from dist_harness import run_ranks
from models.gpt import GPT, GPTConfig
from parity import assert_tensors_match
from test_torch_distributed import rows

import zeroc

MAX_NORM = 0.05  # below the accumulated gradients' norm: clipping changes every gradient
BATCH = 8
MICRO_STEPS = (2, 4)
# (zero, schedule, pp_reshard, scaling, no-sync switch). "mean": (loss / k).backward();
# "seed": loss.backward(gradient=f_i), another factor per micro-step.
CASES = {
    2: (
        (0, "1f1b", False, "mean", "method"),
        (3, "dualpipev", False, "seed", "context"),
        (3, "1f1b", True, "seed", "method"),
    ),
    4: (
        (3, "1f1b", False, "mean", "context"),
        (0, "dualpipev", False, "seed", "method"),
    ),
}


def make_gpt() -> GPT:
    """The zoo GPT (tied embedding head) with 4 layers: DualPipeV at pp=2 runs 4 stages."""
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32), seed=5)


def _batches(count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    config = make_gpt().config
    vocab, block = config.vocab_size, config.block_size
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (count, BATCH, block + 1), generator=generator)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _backward(loss: torch.Tensor, scaling: str, index: int, count: int) -> None:
    if scaling == "mean":
        (loss / count).backward()
    else:
        loss.backward(gradient=torch.tensor(0.25 * (index + 1), dtype=loss.dtype))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's gradients in full (collective over the data-parallel group)."""
    out = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            # full_tensor() of a 1-rank mesh may be the gradient itself: clipping changes it.
            out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
    return out


def _executor(compiled):
    from zeroc.frontend.session import SESSION_ATTR, wrapper_of

    return getattr(wrapper_of(compiled), SESSION_ATTR).pipelined_executor()


def _micro_steps(model, run, count: int, scaling: str, switch: str, dp: tuple[int, int],
                 reductions: list[int] | None = None):
    """``count`` micro-steps of ``run``, all but the last without gradient sync; with
    ``reductions``, the per-step ZeRO reductions each micro-step issued."""
    for index, batch in enumerate(_batches(count, seed=count)):
        last = index == count - 1
        if switch == "method" and model is not None:
            model.set_requires_gradient_sync(last)
        quiet = contextlib.nullcontext()
        if switch == "context" and model is not None and not last:
            quiet = zeroc.no_sync(model)
        with quiet:
            _backward(run(*rows(batch, *dp)), scaling, index, count)
        zero = _executor(run).zero if reductions is not None else None
        if zero is not None:
            reductions.append(zero.counts["reduce"])


def _total_norm(model: torch.nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()


def accumulation_job(rank: int, world: int, cases: tuple) -> dict:
    out = {}
    for zero, schedule, reshard, scaling, switch in cases:
        torch._dynamo.reset()
        model = zeroc.parallelize(make_gpt(), zero=zero, pp=2)
        compiled = torch.compile(model, backend="zeroc", options={
            "schedule": schedule, "microbatches": 4, "pp_reshard": reshard})
        dp = (zeroc.data_parallel_rank(model), zeroc.data_parallel_size(model))
        result = {"reductions": []}
        for count in MICRO_STEPS:
            model.zero_grad(set_to_none=True)
            _micro_steps(model, compiled, count, scaling, switch, dp, result["reductions"])
            result[count] = _grads(model)
        result["total_norm"] = _total_norm(model)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        result["clip_norm"] = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
        result["clipped"] = _grads(model)
        out[(zero, schedule, reshard, scaling, switch)] = result
    return out


@functools.cache  # both tests read the same references (read-only)
def _eager(scaling: str) -> dict:
    model = make_gpt()
    result = {}
    for count in MICRO_STEPS:
        model.zero_grad(set_to_none=True)
        _micro_steps(None, model, count, scaling, "none", (0, 1))
        result[count] = _grads(model)
    result["total_norm"] = _total_norm(model)
    result["clip_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
    result["clipped"] = _grads(model)
    return result


def _check_gradients(ranks: list[dict], case: tuple, key, expected: dict) -> None:
    held: set[str] = set()
    for rank, result in enumerate(ranks):
        grads = result[case][key]
        held |= set(grads)
        # Every gradient a rank holds is the whole model's (a tied embedding too).
        assert_tensors_match({n: expected[n] for n in grads}, grads,
                             f"{case} rank {rank} {key}")
    assert held == set(expected), (case, key, held ^ set(expected))


@pytest.fixture(scope="module", params=sorted(CASES))
def world_results(request) -> tuple[int, list[dict]]:
    world = request.param
    return world, run_ranks(accumulation_job, world, CASES[world], timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_accumulated_gradients_equal_eager(world_results) -> None:
    world, ranks = world_results
    for case in CASES[world]:
        expected = _eager(case[3])
        for count in MICRO_STEPS:
            _check_gradients(ranks, case, count, expected[count])
        if world == 4 and not case[2]:  # dp=2, gathered once per step: micro-steps reduce
            for result in ranks:        # nothing, the synchronised one every bucket once
                counts = result[case]["reductions"]
                assert counts == [0, counts[1], 0, 0, 0, counts[1]] and counts[1] > 0, counts


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_torch_clip_grad_norm_is_the_pipeline_norm(world_results) -> None:
    world, ranks = world_results
    for case in CASES[world]:
        expected = _eager(case[3])
        assert expected["clip_norm"] > MAX_NORM
        for result in ranks:
            for key in ("total_norm", "clip_norm"):
                assert result[case][key] == pytest.approx(expected[key], rel=1e-5), (case, key)
        _check_gradients(ranks, case, "clipped", expected["clipped"])
