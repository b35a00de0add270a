"""NCCL's point-to-point ordering, checked on a CPU (``zeroc.runtime.nccl_order``).

NCCL matches a pair's transfers in issue order, each waiting on its stream for its
counterpart, and runs all of a rank's ``batch_isend_irecv`` groups on one stream (the process
group's communicator for the device); gloo matches by tag and hides an order NCCL would hang
on. The matcher plays
NCCL's rules on what each rank issued; a planned world (``zeroc.explain(world=...)``) runs
the real pipeline executors on fake CUDA tensors, records every transfer and wait, and
refuses an order that would deadlock. Every schedule at pp 2 and 4 and DualPipe and
DualPipeV at pp 8 too (the linear schedules' ranks differ only in how many forwards they run
ahead of their first backward, which pp=4's ranks already take from 3 down to 0; the
bidirectional ones pair every rank with a mirror rank), two micro-batch counts at pp 2, dp 1
and 2 (dp 2 at pp 2 and 4: a pp=8 x dp=2 plan of 16 ranks costs several times a pp=8 one and
adds no pair of pipeline ranks dp=2 at pp 2 and 4 does not) and ZeRO 0-3, DualPipe's
overlapped actions split (F, sends, B) and merged (``pp_reshard=True``, at pp 2 for DualPipe,
at pp 2 and 4 for DualPipeV) must pass; the order the executor used to issue (each receive
posted alone, ahead of the sends) must be reported, naming both ranks' queues.

Every planned world checks its order (``world_plan``), so three of these plans run in other
files, which plan them anyway: 1F1B at pp 2 with 4 micro-batches and DualPipeV at pp 2 with 4
(split) in ``tests/test_fake_replay.py`` (dp 2, ZeRO-3), ZB1P at pp 2 with 4 in
``tests/test_fake_params.py`` (dp 4, ZeRO-3), and DualPipeV merged at pp 2 in
``tests/test_program.py`` (ZeRO-3, its F&B graphs asserted); DualPipeV's pp 2 plan with 8
micro-batches here runs split. DualPipe runs pp stages (DualPipeV 2 * pp): one block each.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from models.gpt import GPT, GPTConfig

import zeroc
from zeroc.passes.program.schedule import build_schedule
from zeroc.runtime import nccl_order
from zeroc.runtime.nccl_order import P2PDeadlockError, P2PRecord, Transfer, find_deadlock
from zeroc.runtime.pipeline import messages as pipeline_messages

SCHEDULES = ("gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev")
BATCH = 32


def _record(*transfers: tuple[bool, int, int | None, str]) -> P2PRecord:
    """A rank's record from ``(send, peer, batch, label)`` tuples, nothing waited."""
    return P2PRecord(transfers=[Transfer(send, peer, (4, 8), "float32", "cuda:0", batch, label)
                                for send, peer, batch, label in transfers])


def test_the_issue_order_of_single_transfers_deadlocks_and_batches_do_not() -> None:
    # 1F1B at pp=2: rank 0 sends F0, waits for B0, sends F1; rank 1 receives F0 and F1 first.
    singles = {
        0: _record((True, 1, None, "F0"), (False, 1, None, "B0"), (True, 1, None, "F1"),
                   (False, 1, None, "B1")),
        1: _record((False, 0, None, "F0"), (False, 0, None, "F1"), (True, 0, None, "B0"),
                   (True, 0, None, "B1")),
    }
    report = find_deadlock(singles)
    assert report is not None
    assert "rank 0 waits on: recv from 1 [4, 8] (B0)" in report
    assert "rank 1 waits on: recv from 0 [4, 8] (F1)" in report
    # The lowering's groups issued whole: F1 with B0 on rank 0; F1, then B0 on rank 1.
    grouped = {
        0: _record((True, 1, 0, "F0"), (True, 1, 1, "F1"), (False, 1, 1, "B0"),
                   (False, 1, 2, "B1")),
        1: _record((False, 0, 0, "F0"), (False, 0, 1, "F1"), (True, 0, 2, "B0"),
                   (True, 0, 3, "B1")),
    }
    assert find_deadlock(grouped) is None


def test_a_ranks_batches_share_one_stream_whatever_their_peers() -> None:
    """Three ranks in a ring, each sending to the next before receiving from the previous:
    lone transfers run on a stream per pair and finish; as batches they share the rank's
    stream, so every send waits for a receive queued behind its peer's own send."""
    ring = [((True, 1), (False, 2)), ((True, 2), (False, 0)), ((True, 0), (False, 1))]
    lone = {r: _record(*((send, peer, None, f"r{r}") for send, peer in order))
            for r, order in enumerate(ring)}
    assert find_deadlock(lone) is None
    batched = {r: _record(*((send, peer, k, f"r{r}") for k, (send, peer) in enumerate(order)))
               for r, order in enumerate(ring)}
    report = find_deadlock(batched)
    assert report is not None
    for rank, (send, _) in enumerate(ring):
        assert f"rank {rank} waits on: send to {send[1]} [4, 8] (r{rank}); recv from" in report
    with pytest.raises(P2PDeadlockError, match="one after another on one stream"):
        nccl_order.check(batched, "a ring")
    # One batch per rank holding both transfers: NCCL progresses them together.
    together = {r: _record(*((send, peer, 0, f"r{r}") for send, peer in order))
                for r, order in enumerate(ring)}
    assert find_deadlock(together) is None
    # A lone transfer and a batched one never meet: they are on different communicators.
    mixed = {0: _record((True, 1, None, "F0")), 1: _record((False, 0, 0, "F0"))}
    assert "rank 0 waits on: send to 1" in find_deadlock(mixed)


def test_a_wait_before_issuing_orders_the_streams_and_mismatches_are_named() -> None:
    # Rank 0 waits for its receive before it sends: a cycle through the wait.
    waiting = {0: _record((False, 1, None, "B0"), (True, 1, None, "F0")),
               1: _record((False, 0, None, "F0"), (True, 0, None, "B0"))}
    waiting[0].waits.append(0)
    waiting[0].transfers[1] = Transfer(True, 1, (4, 8), "float32", "cuda:0", None, "F0", 1)
    waiting[1].waits.append(0)
    waiting[1].transfers[1] = Transfer(True, 0, (4, 8), "float32", "cuda:0", None, "B0", 1)
    assert "rank 0 waits on: recv from 1 [4, 8] (B0)" in find_deadlock(waiting)
    mismatched = {0: _record((True, 1, None, "F0")),
                  1: P2PRecord(transfers=[Transfer(False, 0, (4, 9), "float32", "cuda:0",
                                                   None, "F0")])}
    assert "shapes or dtypes differ" in find_deadlock(mismatched)
    with pytest.raises(P2PDeadlockError, match="would deadlock under NCCL"):
        nccl_order.check(mismatched, "a test")


def _gpt(layers: int) -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, d_model=32),
               seed=1)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (BATCH, 17), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _cases() -> list[tuple[str, int, int, int, int]]:
    """Every schedule at pp 2 and 4 (the DualPipes at 8 too) at its fewest micro-batches,
    and at pp 2 with twice as many (the steady state between warm-up and cool-down); dp (2
    only below pp 8) and ZeRO vary."""
    cases = []
    for k, (schedule, pp) in enumerate(itertools.product(SCHEDULES, (2, 4, 8))):
        if pp == 8 and "dual" not in schedule:
            continue
        least = build_schedule(schedule, pp, 2 * pp if "dual" in schedule else pp).num_stages
        for j, microbatches in enumerate((max(least, 2 * pp) if "dual" in schedule else pp,
                                          2 * pp if "dual" not in schedule else 4 * pp)):
            if j == 0 or pp == 2:
                dp = 1 + (k + j) % 2 if pp < 8 else 1
                cases.append((schedule, pp, microbatches, dp, (k + j) % 4))
    return [c for c in cases if BATCH % c[2] == 0]


# Cases another file's planned world already checks (the module docstring names each).
ELSEWHERE = {("1f1b", 2, 4): "tests/test_fake_replay.py",
             ("zb1p", 2, 4): "tests/test_fake_params.py",
             ("dualpipev", 2, 4): "tests/test_fake_replay.py"}
# Merged (pp_reshard=True) DualPipeV at pp 2 is planned in tests/test_program.py.
MERGED_ELSEWHERE = {("dualpipev", 2)}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_issues_an_order_nccl_matches(schedule: str) -> None:
    cases = [c for c in _cases() if c[0] == schedule and c[:3] not in ELSEWHERE]
    lowered = set()
    for _, pp, microbatches, dp, zero in cases:
        layers = 2 * pp if schedule == "dualpipev" else pp  # one block per stage
        # DualPipe's overlapped actions: split into F, sends, B where the stage graphs hold
        # no collective (the default), one interleaved F&B graph where they do.
        reshard = ("dual" in schedule and dp == 2 and zero > 0
                   and (schedule, pp) not in MERGED_ELSEWHERE)
        plan = zeroc.explain(_gpt(layers), _batch(), world=pp * dp, pp=pp, zero=zero,
                             device="cuda", options={"schedule": schedule, "pp_reshard": reshard,
                                                     "microbatches": microbatches})
        stats = [dict(p.stats) for p in plan.passes if p.pass_name == "comm_lowering"]
        lowered |= {key for row in stats for key in row if key.startswith("fb_")}
        if "dual" in schedule:
            assert ("fb_merged_here" if reshard else "fb_split_here") in lowered, stats
    # Each plan above raised if NCCL could not match its order; every degree ran.
    assert {c[1] for c in cases} == ({2, 4, 8} if "dual" in schedule else {2, 4}), cases
    assert lowered == ({"fb_split_here", "fb_merged_here"} if "dual" in schedule else set())
    assert len(_cases()) >= 17 and set(ELSEWHERE) <= {c[:3] for c in _cases()}


def test_the_executors_former_order_is_reported_as_a_deadlock(monkeypatch) -> None:
    """Receives posted one by one ahead of the group's sends, as the executor used to."""
    def singles(sends, receives, group=None):
        works, indices = [], []
        for issued, send in ((receives, False), (sends, True)):
            for tensors, peer, label in issued:
                for tensor in tensors:
                    indices += nccl_order.record([(send, tensor, peer)], batched=False,
                                                 label=label)
        return works, tuple(indices)

    monkeypatch.setattr(pipeline_messages, "post_batch", singles)
    with pytest.raises(P2PDeadlockError, match=r"(?s)rank 0 waits on: .*rank 2 waits on: "):
        zeroc.explain(_gpt(2), _batch(), world=4, pp=2, zero=3, device="cuda",
                      options={"schedule": "1f1b", "microbatches": 4})
