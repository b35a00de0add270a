"""Where a pipelined step makes the host wait for a CUDA device, counted.

docs/pipelines.md ("A steady training step never makes the host wait...") names one wait in a
pipelined call: at its end, before its closing all-gather, ``runtime/pipeline/sync.read_rows``
waits for the previous call's gathered rows to reach the host, and only while the device still
runs that call. The planned world's fake CUDA completes every event at once, so there the wait
is never taken (``tests/test_host_syncs.py`` counts none in steady DualPipeV steps); here the
steady steps of the planned CUDA world are counted again with that read watched, and the CUDA
branch of ``StepSync.finish`` is run with events the test completes by hand, under
``count_host_syncs``: one ``Event.synchronize`` at ``read_rows`` while the previous call's
event is pending, none once it completed, and the step clock's timings never wait.
"""

from __future__ import annotations

import types

import pytest
import torch
from test_host_syncs import steady_syncs  # the planned CUDA world's steady steps

from zeroc.runtime import step_clock
from zeroc.runtime.pipeline import sync as pipeline_sync
from zeroc.runtime.pipeline.sync import StepSync
from zeroc.world.host_syncs import HostSync, count_host_syncs


class _Event:
    """A CUDA event that completes when the test says so (``done``)."""

    done = False
    waits = 0

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = 1.0

    def query(self) -> bool:
        return _Event.done

    def synchronize(self) -> None:
        _Event.waits += 1

    def elapsed_time(self, end: _Event) -> float:
        return (end.at - self.at) * 1000.0


def _sync() -> StepSync:
    """A one-rank pipeline's closing all-gather (no group: the row is the gathered rows)."""
    layout = types.SimpleNamespace(
        batch_inputs=frozenset({0}), global_ranks=(0,), group_name="", loss_kind="micro_mean",
        loss_denominator=None, schedule=types.SimpleNamespace(num_microbatches=2))
    return StepSync({True: [[()]], False: [[()]]}, layout)


def test_a_pipelined_call_waits_once_only_while_the_device_runs_the_previous_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    _Event.done, _Event.waits = False, 0
    pipeline_sync._UNREAD.clear()
    sync, clock = _sync(), step_clock.StepClock(torch.device("cuda"))
    assert clock.events
    batch = [torch.arange(8)]
    scale = sync.loss_scale(batch, torch.device("cpu"))

    def call() -> list[HostSync]:
        clock.step_done([clock.mark() for _ in range(3)], train=True)
        with count_host_syncs() as syncs:
            sync.finish(torch.zeros((), dtype=torch.float64), clock, True, batch, scale)
        return syncs

    assert call() == []  # the first call: nothing earlier to read
    assert len(pipeline_sync._UNREAD) == 1  # its rows, on their way to the host
    syncs = call()  # the device still runs the first call: the one wait
    assert [s.what for s in syncs] == ["torch.cuda.Event.synchronize"], syncs
    assert "pipeline/sync.py" in syncs[0].site and "(read_rows)" in syncs[0].site, syncs
    assert _Event.waits == 1 and sync.timings is None  # no timed step was complete then
    _Event.done = True  # the device passed the second call: nothing to wait for
    assert call() == [] and _Event.waits == 1
    pipeline_sync.read_rows(wait=True, when="the last call")  # as the plan reads them
    assert not pipeline_sync._UNREAD and _Event.waits == 1
    # The third call's row carried timings read from completed events, never waited for.
    assert sync.timings is not None and len(sync.timings.times[0]) == 1


def test_steady_planned_pipeline_steps_read_the_rows_once_per_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """DualPipeV at pp=2 x dp=2 in the planned CUDA world (position 0): no host sync in steps
    3-5, and the one place a GPU could make the host wait is reached once per call, asking to
    wait (for rows a planned step does not have: its device is never behind)."""
    reads: list[tuple[bool, str]] = []
    monkeypatch.setattr(pipeline_sync, "read_rows",
                        lambda wait, when: reads.append((wait, when)))
    syncs, ran = steady_syncs(monkeypatch, 0, 4, 2, {"schedule": "dualpipev", "microbatches": 4})
    assert ran == ["PipelineExecutor"] * 3
    assert syncs == [], syncs
    assert reads[-3:] == [(True, "the previous call")] * 3 and len(reads) == 5
