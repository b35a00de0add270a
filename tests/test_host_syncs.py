"""No host synchronization in a steady training step, counted in the fake CUDA world.

``zeroc.world.host_syncs.count_host_syncs`` records every point where the host would wait for a
CUDA device (a value read, a blocking copy between host and device, a data-dependent output
shape, an explicit synchronize) with its call site. The planned world's fake CUDA tensors run
the same code as a real CUDA run: steps 3-5 of a ZeRO-3 (also 0-2) model at pp=1 on 2 ranks
and of a pp=2 x dp=2 DualPipeV pipeline with 4 micro-batches (one representative rank per
pipeline position, as ``zeroc.world.fake_world.plan_position`` plans them) must count none, the
user's loop (forward, ``backward()``, AdamW) included. The pipeline's stage graphs run every
time (no replay) and its loss is a token mean whose denominator is a device tensor, as in a
real run. The pieces that only a real GPU exercises (events read one step late, the late
checks of the gathered rows) are tested on their own.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from models.gpt import GPT, GPTConfig
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)

import zeroc
from zeroc.runtime import fake_replay, step_clock
from zeroc.runtime.pipeline import sync as pipeline_sync
from zeroc.runtime.pipeline.executor import PipelineExecutor
from zeroc.runtime.pipeline.sync import LossScale, StepSync, read_rows
from zeroc.world.fake_world import fake_world, meta_copy, planned_world
from zeroc.world.host_syncs import count_host_syncs

HERE = "test_host_syncs.py"


def test_the_counter_names_each_kind_and_its_call_site() -> None:
    synchronize = torch.cuda.synchronize
    with fake_world(0, 2, 1, "cuda"):
        t = torch.ones(4, device="cuda")
        # A CPU-only torch cannot create CUDA events: an object of the class stands for one.
        event = (torch.cuda.Event() if torch.cuda.is_available()
                 else object.__new__(torch.cuda.Event))
        with count_host_syncs() as syncs:
            for read in (lambda: t.sum().item(), lambda: float(t[0]), lambda: bool(t[1]),
                         lambda: t.tolist()):
                with pytest.raises(DataDependentOutputException):  # fake: no values
                    read()
            t.cpu()
            torch.ones(2).to("cuda")
            torch.cuda.synchronize()
            event.synchronize()
            with pytest.raises(DynamicOutputShapeException):  # fake: no values
                t.nonzero()
            # Not syncs: device work, copies that do not block, CPU tensors.
            (t * 2).sum()
            t.to("cpu", non_blocking=True)
            torch.ones(2).to("cuda", non_blocking=True)
            torch.ones(2) + 1
    assert [s.what for s in syncs] == [
        "aten._local_scalar_dense", "aten._local_scalar_dense", "aten._local_scalar_dense",
        "Tensor.tolist", "copy cuda -> cpu", "copy cpu -> cuda", "torch.cuda.synchronize",
        "torch.cuda.Event.synchronize", "aten.nonzero"]
    assert all(HERE in s.site for s in syncs), syncs
    lines = [int(s.site.split(":")[1].split()[0]) for s in syncs]
    assert lines[4] < lines[5] < lines[6] < lines[7] < lines[8], syncs
    assert torch.cuda.synchronize is synchronize  # restored
    assert "tolist" not in torch.Tensor.__dict__


def _count_targets(layout):
    """A token mean's denominator as a real run computes it: a device tensor of the batch (a
    planned world has none, since values do not exist; here one stands in)."""
    targets = max(layout.batch_inputs)
    return lambda *inputs: (inputs[targets] != -100).sum()


def steady_syncs(monkeypatch, rank: int, world: int, pp: int, options: dict, zero: int = 3):
    """Run 5 training steps as ``rank`` of a fake CUDA world; the host syncs of steps 3-5,
    and how many compiled graphs or pipeline steps ran during them."""
    monkeypatch.setattr(fake_replay, "call", lambda graph, *args: graph(*args))
    ran: list[str] = []
    init = PipelineExecutor.__init__

    def with_denominator(self, program, planned=None) -> None:
        layout = program.pipeline
        if layout.loss_kind == "token_mean" and layout.loss_denominator is None:
            program = dataclasses.replace(program, pipeline=dataclasses.replace(
                layout, loss_denominator=_count_targets(layout)))
            ran.append("device denominator")
        init(self, program, planned)

    monkeypatch.setattr(PipelineExecutor, "__init__", with_denominator)
    from zeroc.runtime.executor import GraphExecutor

    for cls, name in ((GraphExecutor, "__call__"), (PipelineExecutor, "run")):
        original = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, _o=original, **k: (
            ran.append(type(self).__name__), _o(self, *a, **k))[1])
    # Two blocks at pp=1; one per stage of DualPipeV's four at pp=2.
    model = meta_copy(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2 * pp, n_head=2,
                                    d_model=32)))
    counted = []
    with fake_world(rank, world, pp, "cuda"):
        tokens = torch.zeros(8, 16, dtype=torch.long, device="cuda")
        parallel = zeroc.parallelize(model, zero=zero, pp=pp,
                                     planned_world=planned_world(rank, world, pp, "cuda"))
        optimizer = torch.optim.AdamW(parallel.parameters())
        compiled = torch.compile(parallel, backend="zeroc", options=options)
        for step in range(1, 6):
            if step == 3:
                assert "device denominator" in ran or pp == 1
                ran.clear()
            with count_host_syncs() as syncs:
                loss = compiled(tokens, tokens)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            if step >= 3:
                counted += syncs
    return counted, list(ran)


@pytest.mark.parametrize("zero", [3, 0, 1, 2])
def test_steady_pp1_steps_do_not_sync(monkeypatch, zero: int) -> None:
    syncs, ran = steady_syncs(monkeypatch, 0, 2, 1, {}, zero)
    assert ran.count("GraphExecutor") == 6  # compiled forward and backward, 3 steps
    assert syncs == [], syncs


@pytest.mark.parametrize("rank", [0, 2])  # pipeline positions 0 and 1
def test_steady_dualpipev_steps_do_not_sync(monkeypatch, rank: int) -> None:
    syncs, ran = steady_syncs(monkeypatch, rank, 4, 2,
                              {"schedule": "dualpipev", "microbatches": 4})
    assert ran == ["PipelineExecutor"] * 3
    assert syncs == [], syncs


class _Event:
    """A CUDA event that completes when the test says so."""

    done = False
    waits = 0

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = _Event.now

    def query(self) -> bool:
        return _Event.done

    def synchronize(self) -> None:
        _Event.waits += 1

    def elapsed_time(self, end: _Event) -> float:
        return (end.at - self.at) * 1000.0


def test_cuda_marks_are_read_one_step_late_without_waiting(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    _Event.now, _Event.done, _Event.waits = 0.0, False, 0
    clock = step_clock.StepClock(torch.device("cuda"))
    assert clock.events
    tokens = []
    for at in (1.0, 1.5, 3.0):
        _Event.now = at
        tokens.append(clock.mark())
    clock.step_done(tokens, train=True)
    assert clock.latest() is None and _Event.waits == 0  # the device is still running it
    _Event.done = True
    train, seconds = clock.latest()
    assert train and _Event.waits == 0
    assert seconds[1] - seconds[0] == pytest.approx(0.5)
    assert seconds[2] - seconds[0] == pytest.approx(2.0)


def _sync(denominator=None) -> StepSync:
    layout = types.SimpleNamespace(
        batch_inputs=frozenset({0}), global_ranks=(0, 1), group_name="",
        loss_kind="token_mean" if denominator else "micro_mean",
        loss_denominator=denominator,
        schedule=types.SimpleNamespace(num_microbatches=2))
    return StepSync({True: [[()], [()]], False: [[()], [()]]}, layout)


def test_a_batch_mismatch_raises_when_the_next_call_ends() -> None:
    sync = _sync()
    rows = [[1.0, 2.0, 1.0, 0.5, 0.75, 0.25, 5.0, 6.0],
            [1.0, 2.0, 1.0, 0.5, 0.75, 0.25, 5.0, 7.0]]
    with pytest.raises(ValueError, match="different batches in the previous call .*rank 0 "
                                         "and rank 1 differ.*when the next one ends"):
        sync.read(rows, "the previous call")
    sync.read(rows[:1] * 2, "the previous call")
    assert sync.timings.times == (((0.5, 0.75),), ((0.5, 0.75),))
    assert sync.timings.waits == ((0.25,), (0.25,))


def test_a_zero_denominator_gives_nan_zero_gradients_then_an_error() -> None:
    targets = torch.full((4,), -100)
    sync = _sync(lambda *inputs: (inputs[0] != -100).sum())
    scale = sync.loss_scale([targets], torch.device("cpu"))
    assert isinstance(scale, LossScale) and scale.tangent(torch.device("cpu")).item() == 0.0
    clock = step_clock.StepClock(torch.device("cpu"))
    clock.step_done([clock.mark()] * 3, train=True)
    pipeline_sync._UNREAD.clear()
    loss = sync.finish(torch.zeros((), dtype=torch.float64), clock, True, [targets], scale)
    assert loss.isnan()  # eager's mean over no targets
    with pytest.raises(ValueError, match="denominator was 0 for the batch of the last call"):
        read_rows(wait=True, when="the last call")
    assert not pipeline_sync._UNREAD


def test_tuning_times_device_work_with_events(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    _Event.now, _Event.waits = 0.0, 0
    timer = step_clock.RegionTimer(torch.device("cuda"))
    for start, end in ((1.0, 3.0), (3.0, 3.5)):
        _Event.now = start
        with timer.region():
            _Event.now = end
    assert _Event.waits == 0  # nothing waits while the regions run
    assert timer.seconds() == pytest.approx([2.0, 0.5])
    assert _Event.waits == 1  # one wait, after the last region
    host = step_clock.RegionTimer(torch.device("cpu"))
    with host.region():
        pass
    assert not host.events and len(host.seconds()) == 1
