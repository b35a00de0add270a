"""Per-step ZeRO in pipelines overlaps the step's compute (``runtime/pipeline/zero.py``).

- ``zero_order``: stages gather in first-forward order; a parameter's reduction is issued
  after the last group running a B or W of every stage of the rank that reads it (1F1B,
  ZB1P's W, DualPipeV's F&B and a parameter two stages share).
- ``StepZero`` on a recording fake collective: the gathers are issued asynchronously, the
  next stage's (``prefetch``) before this stage waits; a stage's reductions are issued when its
  gradients are complete and waited only when the step's gradients are read; the values are
  those of the blocking path.
"""

from __future__ import annotations

import pytest
import torch

from zeroc.passes.program.comm_lowering import lower_communication
from zeroc.passes.program.schedule import build_schedule
from zeroc.runtime.actions import p2p_groups
from zeroc.runtime.pipeline import zero as pipeline_zero
from zeroc.runtime.pipeline import zero_order as pipeline_zero_order
from zeroc.runtime.pipeline.zero import HoistedParam, StepZero, ZeroOrder, zero_order


def _hoisted(indices, numel: int = 4) -> dict[int, HoistedParam]:
    return {i: HoistedParam(index=i, name=f"w{i}", shape=(numel,), numel=numel,
                            group_name="dp", zero_stage=3, param_dtype=None, reduce_dtype=None)
            for i in indices}


def _groups(name: str, ranks: int, microbatches: int, rank: int):
    schedule = lower_communication(build_schedule(name, ranks, microbatches))
    return tuple(p2p_groups(schedule.actions[rank])), schedule


def _last(groups, kinds: tuple[str, ...], stage: int) -> int:
    return max(p for p, g in enumerate(groups) for a in g for part in a.parts()
               if part.kind.value in kinds and part.stage == stage)


def test_1f1b_reduces_after_the_last_backward() -> None:
    groups, _ = _groups("1f1b", 2, 4, rank=1)
    order = zero_order(groups, {1: (0, 1)}, _hoisted((0, 1)))
    assert order.gathers == ((1, (0, 1)),)
    assert dict(order.reduces) == {_last(groups, ("B",), 1): (1, (0, 1))}


def test_zero_bubble_reduces_after_the_last_weight_gradient() -> None:
    groups, _ = _groups("zb1p", 2, 4, rank=0)
    order = zero_order(groups, {0: (0,)}, _hoisted((0,)))
    last_w = _last(groups, ("W",), 0)
    assert dict(order.reduces) == {last_w: (0, (0,))}
    assert last_w > _last(groups, ("I",), 0) if any(
        part.kind.value == "I" for g in groups for a in g for part in a.parts()) else True


def test_dualpipev_orders_by_first_forward_and_waits_for_a_shared_parameter() -> None:
    groups, schedule = _groups("dualpipev", 2, 4, rank=0)
    stages = sorted({a.stage for a in schedule.actions[0] if a.kind.value == "F"})
    assert stages == [0, 3]
    # w0 only in s0, w1 only in s3, w2 in both (a tied embedding)
    order = zero_order(groups, {0: (0, 2), 3: (1, 2)}, _hoisted((0, 1, 2)))
    assert order.gathers == ((0, (0, 2)), (3, (1,)))  # w2 is gathered once, by s0
    last0, last3 = _last(groups, ("B", "W"), 0), _last(groups, ("B", "W"), 3)
    reduce_stage = order.reduce_stage()
    assert reduce_stage[0] == 0 and reduce_stage[1] == 3
    assert reduce_stage[2] == (0 if last0 > last3 else 3)  # after both stages' backwards
    positions = {i: p for p, (_, indices) in order.reduces.items() for i in indices}
    assert positions[2] == max(last0, last3)


class _Recorder:
    """A fake data-parallel pair: each collective is logged when issued and when waited, and
    computes what two ranks with equal inputs would."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def work(self, name: str):
        log = self.log

        class Work:
            def wait(self) -> None:
                log.append(f"wait {name}")
        return Work()

    def all_gather(self, out, inp, group=None, async_op=False):
        assert async_op  # never blocking
        out.copy_(inp.repeat(2))
        self.log.append(f"gather {inp.numel()}")
        return self.work(f"gather {inp.numel()}")

    def reduce_scatter(self, out, inp, op=None, group=None, async_op=False):
        assert async_op
        out.copy_(inp.view(2, -1).sum(0))
        self.log.append(f"reduce {inp.numel()}")
        return self.work(f"reduce {inp.numel()}")


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    rec = _Recorder()
    monkeypatch.setattr(pipeline_zero, "group_size", lambda name: 2)
    monkeypatch.setattr(pipeline_zero_order, "group_size", lambda name: 2)
    monkeypatch.setattr(pipeline_zero, "resolve_group", lambda name: None)
    monkeypatch.setattr(pipeline_zero, "all_gather_single", rec.all_gather)
    monkeypatch.setattr(pipeline_zero, "reduce_scatter_single", rec.reduce_scatter)
    return rec


def _step_zero(prefetch: int) -> tuple[StepZero, list[torch.Tensor]]:
    # s0 reads w0 (shard of 2 -> 4), s1 reads w1 (shard of 3 -> 6); tiny buckets: one each
    hoisted = {0: HoistedParam(0, "w0", (4,), 4, "dp", 3, None, None),
               1: HoistedParam(1, "w1", (6,), 6, "dp", 3, None, None)}
    order = ZeroOrder(gathers=((0, (0,)), (1, (1,))), reduces={5: (1, (1,)), 9: (0, (0,))})
    zero = StepZero(hoisted, {True: order, False: order}, bucket_mb=1e-6, prefetch=prefetch)
    return zero, [torch.arange(2.0), torch.arange(3.0) + 10]


@pytest.mark.parametrize("prefetch", [0, 1])
def test_gathers_are_issued_ahead_and_waited_at_first_use(recorder: _Recorder,
                                                          prefetch: int) -> None:
    zero, inputs = _step_zero(prefetch)
    zero.begin(inputs)
    assert recorder.log == (["gather 2"] if prefetch else [])
    zero.gather(0, inputs)
    if prefetch:  # s1's bucket is in flight while s0 computes
        assert recorder.log == ["gather 2", "gather 3", "wait gather 2"]
    else:
        assert recorder.log == ["gather 2", "wait gather 2"]
    assert torch.equal(zero.parameter(0, inputs), torch.tensor([0.0, 1.0, 0.0, 1.0]))
    zero.gather(1, inputs)
    assert recorder.log[-1] == "wait gather 3"
    assert torch.equal(zero.parameter(1, inputs), torch.tensor([10.0, 11, 12, 10, 11, 12]))
    assert zero.counts["all_gather"] == 2


def test_reductions_are_issued_when_complete_and_waited_at_the_end(recorder: _Recorder) -> None:
    zero, inputs = _step_zero(prefetch=1)
    zero.begin(inputs)
    grads = {0: torch.ones(4), 1: torch.full((6,), 3.0)}
    for position in range(12):
        zero.reduce_ready(position, grads, inputs)
        if position == 5:  # s1's gradient is complete: reduced now, its full gradient dropped
            assert recorder.log[-1] == "reduce 6" and 1 not in grads and 0 in grads
    assert [e for e in recorder.log if e.startswith("reduce")] == ["reduce 6", "reduce 4"]
    assert not any(e.startswith("wait reduce") for e in recorder.log)
    zero.reduce(grads, inputs)
    assert recorder.log[-2:] == ["wait reduce 6", "wait reduce 4"]
    # summed over the two ranks, averaged: the shard of this rank (the first half)
    assert torch.equal(grads[0], torch.ones(2)) and torch.equal(grads[1], torch.full((3,), 3.0))
    assert zero.counts["reduce"] == 2
    zero.end()


def test_a_step_without_early_reductions_reduces_at_the_end(recorder: _Recorder) -> None:
    zero, inputs = _step_zero(prefetch=1)
    zero.begin(inputs)
    grads = {0: torch.ones(4), 1: torch.full((6,), 3.0)}
    zero.reduce(grads, inputs)  # no-sync accumulation: the sum arrives here
    assert torch.equal(grads[0], torch.ones(2)) and torch.equal(grads[1], torch.full((3,), 3.0))
    assert zero.counts["reduce"] == 2  # blocking: issued and waited here
