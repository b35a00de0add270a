"""Timestamps of a pipeline step's actions: CUDA events on CUDA, the host clock elsewhere.

On a CUDA device the host clock measures when work was *queued*, not when it ran, so the
executor records a CUDA event at each mark. The events are read without making the host
wait: a step's marks become seconds once its events have completed (``Event.query()``),
which is checked when a later step ends, so the timings a step reports are those of the
latest earlier step whose events are done (usually the one before it; none after the first
step). Every mark is then the host time of that step's first mark plus the device time
elapsed since its first event. At most ``PENDING`` steps wait to be read; an older one is
dropped (its timings are only for the plan). On the CPU, or while planning on fake tensors
(no device exists), marks are ``time.time()`` and a step's seconds are known when it ends.

``host_row(values, device)`` puts host floats on the step's device without a blocking copy
(through pinned memory on CUDA). ``RegionTimer`` times whole regions of work (a tuning
trial's training steps, one op): on CUDA a pair of events around each region, read after
the last one with one synchronize outside every timed region; elsewhere the host clock.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["PENDING", "RegionTimer", "StepClock", "host_row"]

log = logging.getLogger(__name__)

PENDING = 4  # steps whose events may wait to be read at once


class StepClock:
    """``mark()`` returns a token; ``step_done(tokens, train)`` hands in a step's tokens;
    ``latest()`` gives ``(train, seconds)`` of the latest step whose marks are known."""

    def __init__(self, device: torch.device, simulated: bool = False) -> None:
        self.events = device.type == "cuda" and not simulated and torch.cuda.is_available()
        self._first: Any = None
        self._first_host = 0.0
        self._pending: collections.deque[tuple[bool, list[Any], Any, float]] = (
            collections.deque())
        self._latest: tuple[bool, list[float]] | None = None

    def mark(self) -> Any:
        """A timestamp token for now (an event recorded on the current stream, or a float)."""
        if not self.events:
            return time.time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if self._first is None:
            self._first, self._first_host = event, time.time()
        return event

    def step_done(self, tokens: list[Any], train: bool) -> None:
        """The marks of one step, in order (the next ``mark()`` starts another step)."""
        if not self.events:
            self._latest = (train, [float(t) for t in tokens])
            return
        if tokens:
            self._pending.append((train, tokens, self._first, self._first_host))
        self._first = None
        while len(self._pending) > PENDING:
            self._pending.popleft()

    def latest(self, wait: bool = False) -> tuple[bool, list[float]] | None:
        """``(train, seconds)`` of the latest step whose marks are known. Never waits for the
        device unless ``wait`` (when the plan is read, outside any step)."""
        while self._pending:
            train, tokens, first, first_host = self._pending[0]
            # The last mark first: while it is pending, one query. Once it completed, the
            # earlier marks (recorded before it on the same stream) have too; each is asked
            # anyway, so that no elapsed time is read from an event not shown complete.
            if not all(token.query() for token in reversed(tokens)):
                if not wait:
                    break
                tokens[-1].synchronize()
            self._pending.popleft()
            self._latest = (train, [first_host + first.elapsed_time(t) / 1000.0
                                    for t in tokens])
        return self._latest


def host_row(values: list[float], device: torch.device, pinned: bool) -> torch.Tensor:
    """``values`` as a float64 tensor on ``device``. ``pinned``: copied from pinned host
    memory without blocking (a CUDA device); a blocking copy to a CUDA device would wait for
    every kernel queued before it. A CPU ``device`` takes the row as it is."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=torch.float64)
    row = torch.tensor(values, dtype=torch.float64, pin_memory=pinned)
    return row.to(device, non_blocking=True)


class RegionTimer:
    """Seconds of each ``with timer.region():`` block: the device's time between two CUDA
    events on CUDA (what the block queued, as it ran on the device), the host clock
    (``time.perf_counter``) elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.events = torch.device(device).type == "cuda" and torch.cuda.is_available()
        self._spans: list[Any] = []

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """Time the block (appended to ``seconds()`` when it ends without raising)."""
        if not self.events:
            start = time.perf_counter()
            yield
            self._spans.append(time.perf_counter() - start)
            return
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        yield
        end.record()
        self._spans.append((start, end))

    def seconds(self) -> list[float]:
        """Every timed region's seconds, in order; on CUDA waits once for the last event."""
        if self.events and self._spans:
            self._spans[-1][1].synchronize()
        return [s if isinstance(s, float) else s[0].elapsed_time(s[1]) / 1000.0
                for s in self._spans]
