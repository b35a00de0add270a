"""Timestamps of a pipeline step's actions: CUDA events on CUDA, the host clock elsewhere.

On a CUDA device the host clock measures when work was *queued*, not when it ran, so the
executor records a CUDA event at each mark and converts them after the step: one
synchronization per step, then every mark is the host time of the step's first event plus
the device time elapsed since it. On the CPU, or while planning on fake tensors (no device
exists), marks are ``time.time()``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["StepClock"]


class StepClock:
    """``mark()`` returns a token; ``seconds(tokens)`` turns tokens into host seconds."""

    def __init__(self, device: torch.device, simulated: bool = False) -> None:
        self.events = device.type == "cuda" and not simulated and torch.cuda.is_available()
        self._first: Any = None
        self._first_host = 0.0

    def mark(self) -> Any:
        """A timestamp token for now (an event recorded on the current stream, or a float)."""
        if not self.events:
            return time.time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if self._first is None:
            self._first, self._first_host = event, time.time()
        return event

    def seconds(self, tokens: list[Any]) -> list[float]:
        """Host seconds of ``tokens`` (synchronizes the device once when they are events)."""
        if not self.events or not tokens:
            return [float(t) for t in tokens]
        tokens[-1].synchronize()
        return [self._first_host + self._first.elapsed_time(t) / 1000.0 for t in tokens]
