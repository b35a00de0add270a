"""Failures across ranks are loud and bounded: diverging plans and a rank that dies mid-step."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
from dist_harness import run_ranks
from models.gpt import GPT, GPTConfig


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 64, (2, 17), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def diverging_options(rank: int, world: int) -> str:
    """Rank 1 compiles with other bucketing, so its graphs differ from rank 0's."""
    import zeroc

    model = zeroc.parallelize(GPT(GPTConfig.tiny(), seed=1), zero=3)
    options = {"bucket_mb": 0.01 if rank == 0 else 1000.0}
    compiled = torch.compile(model, backend="zeroc", options=options)
    try:
        compiled(*_batch(rank))
    except Exception as error:  # the test inspects what every rank raised
        return f"{type(error).__name__}: {error}"
    return "no error"


def diverging_stages(rank: int, world: int) -> str:
    """pp=2 x dp=2: the second data-parallel rank of each position recomputes activations,
    so its stage graphs differ from its replica's."""
    import zeroc

    model = zeroc.parallelize(GPT(GPTConfig.tiny(), seed=1), zero=3, pp=2)
    options = {"microbatches": 2, "activation_recompute": rank % 2 == 1}
    compiled = torch.compile(model, backend="zeroc", options=options)
    try:
        compiled(*_batch(rank % 2))
    except Exception as error:  # the test inspects what every rank raised
        return f"{type(error).__name__}: {error}"
    return "no error"


class _Cholesky(torch.nn.Module):
    """A layer, then the Cholesky factor of its Gram matrix shifted by ``shift``: a shift
    that leaves it not positive-definite fails in this rank's own op, in a graph whose ZeRO
    gathers communicate."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        gram = h.T @ h + shift * torch.eye(8)
        return torch.linalg.cholesky(gram).sum()


def local_error(rank: int, world: int) -> str:
    """Both ranks alive and in step; each one's own op fails (a value error, not a collective)."""
    import zeroc

    torch.manual_seed(0)
    model = zeroc.parallelize(_Cholesky(), zero=3)
    compiled = torch.compile(model, backend="zeroc")
    x = torch.randn(16, 8)
    compiled(x, torch.tensor(10.0)).backward()  # compiled and run once, ranks in step
    try:
        compiled(x, torch.tensor(-1e6))
    except Exception as error:  # the test inspects what every rank raised
        return f"{type(error).__name__}: {error}"
    return "no error"


def dies_mid_step(rank: int, world: int) -> tuple[str, float]:
    """Rank 1 exits after its forward; rank 0's backward must fail fast, not hang."""
    import zeroc

    model = zeroc.parallelize(GPT(GPTConfig.tiny(), seed=1), zero=3)
    compiled = torch.compile(model, backend="zeroc")
    compiled(*_batch(rank)).backward()  # one full step: everything compiled, ranks in step
    loss = compiled(*_batch(rank))
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        loss.backward()
    except Exception as error:  # the test inspects the error
        return f"{type(error).__name__}: {error}", time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.timeout(300)
def test_ranks_with_different_plans_all_raise_naming_the_difference() -> None:
    results = run_ranks(diverging_options, 2, timeout=240)
    for text in results:
        assert text.startswith("PlanMismatchError"), text
        assert "compiled different plans for g0.forward" in text
        assert "first difference at line" in text and "has" in text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_stage_graphs_are_compared_across_data_parallel_ranks() -> None:
    results = run_ranks(diverging_stages, 4, timeout=240)
    for text in results:
        assert text.startswith("PlanMismatchError"), text
        assert re.search(r"compiled different plans for g0\.s[01]\.forward", text), text
        assert "first difference at line" in text


@pytest.mark.timeout(300)
def test_a_rank_that_dies_mid_step_stops_the_others_with_a_clear_error() -> None:
    results = run_ranks(dies_mid_step, 2, timeout=240, may_exit=frozenset({1}))
    assert results[1] is None
    text, seconds = results[0]
    assert text.startswith("CollectiveError: zeroc: rank 0 failed in g0.backward"), text
    assert "Another rank probably died" in text
    assert seconds < 60


@pytest.mark.timeout(300)
def test_a_local_error_on_every_rank_is_not_blamed_on_another_rank() -> None:
    """Every rank fails in its own op (not positive-definite): each raises that error as it
    is, not a CollectiveError saying that another rank probably died."""
    results = run_ranks(local_error, 2, timeout=240)
    for text in results:
        assert "not positive-definite" in text, text
        assert not text.startswith("CollectiveError") and "probably died" not in text, text


@pytest.mark.parametrize(("error", "collective"), [
    (RuntimeError("expected scalar type Float but found BFloat16"), False),
    (RuntimeError("shape '[4, 8]' is invalid for input of size 30"), False),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
                  "peer [127.0.0.1]:40212"), True),
    (RuntimeError("Timed out waiting 1800000ms for recv operation to complete"), True),
    (torch.distributed.DistBackendError("NCCL communicator was aborted"), True),
])
def test_the_other_rank_hint_only_when_a_collective_failed(error: Exception,
                                                           collective: bool) -> None:
    from zeroc.runtime.errors import CollectiveError
    from zeroc.runtime.executor import GraphExecutor, collective_failed

    def fail(inputs: list) -> None:
        raise error

    executor = GraphExecutor(torch.fx.symbolic_trace(torch.nn.Identity()), "g0.forward", fail)
    executor.communicates = True  # as a graph with ZeRO collectives
    assert collective_failed(error) is collective
    with pytest.raises(RuntimeError) as info:
        executor([torch.ones(1)])
    if collective:
        assert isinstance(info.value, CollectiveError) and info.value.__cause__ is error
        assert "Another rank probably died" in str(info.value)
    else:
        assert info.value is error


def test_the_graph_check_agrees_through_the_store_without_aligned_compiles() -> None:
    """The cross-rank check publishes each compiled text in the job's store: a rank that
    compiles a text its peer compiled earlier (the peer reuses that graph and compiles
    nothing now) passes at once; two ranks stuck on different texts both raise, each naming
    both ranks' first differing line."""
    import threading

    from zeroc.runtime.consistency import PlanMismatchError, _Exchange, text_digest

    store = torch.distributed.HashStore()
    ranks = [0, 1]

    def agree(rank: int, text: str, out: dict) -> None:
        try:
            _Exchange(store, "zeroc/graphs/t", rank, ranks).agree("g1.forward", text,
                                                                  text_digest(text))
            out[rank] = "ok"
        except PlanMismatchError as error:
            out[rank] = str(error)

    same = "all_gather(f32[64], '0')\nreduce_scatter(f32[128], '0')"
    done: dict = {}
    threads = [threading.Thread(target=agree, args=(r, same, done)) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert done == {0: "ok", 1: "ok"}
    # Rank 1 reuses its graph; rank 0 compiles the same collectives again: no wait.
    agree(0, same, done)
    assert done[0] == "ok"
    texts = {0: same, 1: same.replace("f32[128]", "f32[256]")}
    done = {}
    threads = [threading.Thread(target=agree, args=(r, texts[r] + "\nx", done)) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    for rank in ranks:
        assert "compiled different plans for g1.forward" in done[rank], done
        assert "first difference at line 2" in done[rank]
        assert "f32[128]" in done[rank] and "f32[256]" in done[rank]
