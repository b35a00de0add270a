"""A failed pipeline step never hangs or mixes steps; an op that compiles at pp=1 compiles at pp=2.

Each job runs 2 gloo ranks at pp=2 (dp=1):

- ``cholesky``: a loss through ``torch.linalg.cholesky`` (whose error check AOTAutograd traces
  as an effectful op with tokens the stage's arguments lacked) trains and evaluates at pp=2
  as eager does, one small matrix per sample; a Cholesky of the batch's Gram matrix, which is
  no sum over samples, is refused naming the ``matmul`` that combines the samples.
- ``caught``: a step numbered one ahead on one rank (a call counted there but never met by
  its peer) raises ``StepMismatchError`` on both ranks before anything moves, and the next
  step, realigned, trains; then rank 1's stage raises (an op that fails on a flag) and both
  loops catch and go on: rank 0 raises ``PipelineAbortedError`` naming rank 1's exception
  within seconds, and every later step raises it at once on both ranks, never a hang or a step
  paired with another.
- ``uncaught``: rank 1's exception leaves its loop and its process stays up for a while (as
  an NCCL rank's would: no closed socket tells the peer): rank 0 raises within seconds.

Before the fix the first job failed with ``TypeError: forward() missing 1 required positional
argument`` on rank 1, the second hung (rank 0 waiting for a message of the failed step) and
the third waited until rank 1's process ended.
"""

from __future__ import annotations

import time

import pytest
import torch
from dist_harness import run_ranks
from torch import nn

FAIL = {"on": False}  # set on one rank: its stages' forward raises
LINGER_S = 15.0  # how long the uncaught job's failing rank stays up after raising
OPTIONS = {"schedule": "1f1b", "microbatches": 2}


@torch.library.custom_op("zeroc_faults::maybe_fail", mutates_args=())
def maybe_fail(x: torch.Tensor) -> torch.Tensor:
    """``x`` (a copy), or an error while ``FAIL["on"]``: a stage's compute failing at run time."""
    if FAIL["on"]:
        raise RuntimeError("injected stage failure")
    return x.clone()


@maybe_fail.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


maybe_fail.register_autograd(lambda ctx, grad: grad)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return maybe_fail(torch.tanh(self.l(x)))


class Net(nn.Module):
    """Four blocks and a loss: ``mse``, ``cholesky`` (per sample) or ``gram`` (the batch's)."""

    def __init__(self, loss: str = "mse") -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(4)])
        self.loss = loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        if self.loss == "gram":  # one matrix of the whole batch: not a sum over samples
            return torch.linalg.cholesky(x.T @ x + 10 * torch.eye(8)).sum()
        if self.loss == "cholesky":  # one 2x2 matrix per sample
            m = x.view(x.shape[0], 2, 4)
            return torch.linalg.cholesky(m @ m.transpose(1, 2) + 10 * torch.eye(2)).sum()
        return x.pow(2).mean()


def _pipelined(loss: str) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    import zeroc

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = zeroc.parallelize(Net(loss), zero=0, pp=2)
    compiled = torch.compile(model, backend="zeroc", options=OPTIONS)
    return model, compiled, torch.optim.SGD(model.parameters(), lr=0.1)


def _batch() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def cholesky_job(rank: int, world: int) -> dict:
    from zeroc.sharding.state_dict import full_state_dict

    out: dict = {}
    model, compiled, optimizer = _pipelined("gram")
    try:
        compiled(_batch()).backward()
        out["gram"] = "no error"
    except ValueError as error:
        out["gram"] = str(error)
    model, compiled, optimizer = _pipelined("cholesky")
    losses = []
    for _ in range(2):
        loss = compiled(_batch())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():  # the forward-only stage graphs: traced on this first call
        out["eval"] = compiled(_batch()).item()
    out["losses"], out["state"] = losses, full_state_dict(model)
    return out


def _attempt(run) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        run()
    except Exception as error:  # the loop goes on, as a user's would
        return type(error).__name__, str(error), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def caught_job(rank: int, world: int) -> list[tuple[str, str, float]]:
    from zeroc.pipeline.pipeline_capture import STEPS_ATTR

    model, compiled, optimizer = _pipelined("mse")

    def step() -> None:
        loss = compiled(_batch())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    results = [_attempt(step)]
    counter = getattr(model.layers[0].l.__dict__["_zeroc_flat_weight"], STEPS_ATTR)
    if rank == 1:  # a call counted on rank 1 only: its next step meets rank 0's one behind
        counter.next()
    before = [p.detach().clone() for p in model.parameters()]
    results.append(_attempt(step))
    results.append(("unchanged", str(all(torch.equal(a, p) for a, p in zip(
        before, model.parameters(), strict=True)) and all(
        p.grad is None for p in model.parameters())), 0.0))
    if rank == 0:  # realigned: the mismatch moved nothing, so the next step trains
        counter.next()
    results.append(_attempt(step))
    for number in range(2):  # rank 1's stage raises in the first, both catch and go on
        FAIL["on"] = rank == 1 and number == 0
        results.append(_attempt(step))
        FAIL["on"] = False
    _leave_together(rank)
    return results


def _leave_together(rank: int) -> None:
    """Wait for the other rank through the store: no rank's exit (which closes its gloo
    connections, and so ends its peer's waits) tells the other that a step failed."""
    from zeroc.runtime.torch_compat import default_store

    store = default_store()
    store.set(f"faults/done/{rank}", "1")
    store.wait([f"faults/done/{1 - rank}"])


def uncaught_job(rank: int, world: int) -> tuple[str, str, float]:
    model, compiled, optimizer = _pipelined("mse")
    compiled(_batch()).backward()
    FAIL["on"] = rank == 1
    start = time.monotonic()
    try:
        compiled(_batch()).backward()  # no loop catches this: it ends the rank's training
    except Exception as error:
        elapsed = time.monotonic() - start
        if rank == 1:
            time.sleep(LINGER_S)  # the process stays up: nothing closes its connections
        return type(error).__name__, str(error), elapsed
    return "ok", "", time.monotonic() - start


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cholesky_trains_at_pp2_and_a_batch_gram_loss_is_refused() -> None:
    from parity import assert_tensors_match

    first, second = run_ranks(cholesky_job, 2, timeout=240)
    for out in (first, second):
        assert "not a sum over the batch's samples: matmul at" in out["gram"], out["gram"]
        assert "test_pipeline_faults.py" in out["gram"]
    torch.manual_seed(0)
    eager = Net("cholesky")
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        loss = eager(_batch())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        losses.append(eager(_batch()).item())
    assert first["losses"] == second["losses"] and first["eval"] == second["eval"]
    assert first["losses"] + [first["eval"]] == pytest.approx(losses, rel=1e-5)
    assert_tensors_match(eager.state_dict(), first["state"], "cholesky parameters")


@pytest.fixture(scope="module")
def caught() -> list[list[tuple[str, str, float]]]:
    return run_ranks(caught_job, 2, timeout=240)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_step_mismatch_raises_on_every_rank_before_anything_moves(caught) -> None:
    for rank, results in enumerate(caught):
        assert results[0][0] == "ok", results[0]
        kind, message, _ = results[1]
        assert kind == "StepMismatchError", results[1]
        assert "rank 0 runs step 2 (a training step) and rank 1 step 3" in message, message
        assert results[2] == ("unchanged", "True", 0.0), rank
        assert results[3][0] == "ok", results[3]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stage_error_caught_by_the_loop_stops_every_rank(caught) -> None:
    (kind0, message0, seconds0), (kind1, message1, _) = caught[0][4], caught[1][4]
    assert (kind1, message1) == ("RuntimeError", "injected stage failure")
    assert kind0 == "PipelineAbortedError", caught[0][4]
    assert "step 5 failed on rank 1 (RuntimeError: injected stage failure)" in message0
    assert seconds0 < 30
    for results in caught:  # no later step pairs with the failed one: each raises at once
        kind, message, seconds = results[5]
        assert kind == "PipelineAbortedError", results[5]
        assert "step 5 failed on rank 1" in message and "before its step began" in message
        assert seconds < 5


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_uncaught_stage_error_stops_the_other_rank_within_seconds() -> None:
    first, second = run_ranks(uncaught_job, 2, timeout=LINGER_S + 200)
    assert second[:2] == ("RuntimeError", "injected stage failure")
    kind, message, seconds = first
    assert kind == "PipelineAbortedError", first
    assert "failed on rank 1 (RuntimeError: injected stage failure)" in message
    assert seconds < 10, seconds


def test_step_heads_name_both_ranks_steps_and_kinds() -> None:
    from zeroc.runtime.pipeline.abort import StepMismatchError
    from zeroc.runtime.pipeline.inputs import _check_steps

    _check_steps([[3, 1], [3, 1]], (0, 1))
    with pytest.raises(StepMismatchError, match=r"rank 4 runs step 3 \(a training step\) and "
                       r"rank 6 step 3 \(a forward-only \(no_grad\) step\)"):
        _check_steps([[3, 1], [3, 0]], (4, 6))


class _Stuck:
    """A work that never ends by itself (a receive whose sender's step failed)."""

    def __init__(self) -> None:
        self.release = __import__("threading").Event()

    def wait(self) -> bool:
        self.release.wait()
        return True


def test_a_watched_wait_ends_when_the_store_holds_a_failure() -> None:
    """One process, its own group and store: a blocking wait ends within about ``POLL_S``
    of a failure appearing in the store, and the failure names its rank, step and error."""
    import threading

    import torch.distributed as dist

    from zeroc.runtime.pipeline import abort as pipeline_abort
    from zeroc.runtime.pipeline.abort import (
        ABORT_KEY,
        AbortRecord,
        AbortWatch,
        PipelineAbortedError,
    )
    from zeroc.runtime.torch_compat import default_store

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    store = default_store()  # the group's view of it (prefixed), as every rank reads it
    stuck = _Stuck()
    try:
        watch = AbortWatch(real=True)
        with watch.active(7):
            done = _Stuck()
            done.release.set()
            pipeline_abort.wait(done, torch.device("cpu"))  # an ended wait returns
            record = AbortRecord(3, 7, "ValueError: boom\tx")
            threading.Timer(0.3, store.set, (ABORT_KEY, record.encode())).start()
            start = time.monotonic()
            with pytest.raises(PipelineAbortedError, match="step 7 failed on rank 3 "
                               r"\(ValueError: boom\tx\); this rank stopped waiting for a "
                               "pipeline message"):
                pipeline_abort.wait(stuck, torch.device("cpu"), "a pipeline message")
            assert time.monotonic() - start < 0.3 + 3 * pipeline_abort.POLL_S
        with pytest.raises(PipelineAbortedError, match="before its step began"):
            with watch.active(8):
                pass
        assert AbortRecord.decode(record.encode()) == record
    finally:
        stuck.release.set()
        dist.destroy_process_group()
