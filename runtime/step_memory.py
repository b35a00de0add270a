"""Bytes allocated while a step runs, measured the same way on real and on fake tensors.

``StepMemory`` is a ``TorchDispatchMode`` that records every storage an op outputs, with its
size, and a finalizer that subtracts it when the storage is freed; ``peak`` is the most bytes
alive at once among the storages made since ``start()``. zeroc's executors enter it around
the graphs they run (``tracking_scope``), not around Dynamo's frame (a dispatch mode there
would make Dynamo skip the compiled code), so a compiled step is measured as it runs. On
fake tensors (``zeroc.fake_world``) a storage's size is what the real one would be.

Between ``start()`` and ``stop()`` the optimizer step is measured too when the caller runs it
inside ``active()``. A storage made before ``start()`` (parameters) is not counted: the
caller adds what it held at rest.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["StepMemory", "current_tracker", "tracking", "tracking_scope"]


class _Current(threading.local):
    tracker: StepMemory | None = None
    depth = 0


_CURRENT = _Current()


class StepMemory(TorchDispatchMode):
    """Live bytes and their peak over the storages ops create (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor) and not getattr(value, "is_meta", False):
                self._record(value)
        return out

    def note(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as if an op had just made it (once per storage)."""
        self._record(tensor)

    def _record(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
            return
        key = id(storage)
        if key in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)

    @contextlib.contextmanager
    def active(self) -> Iterator[StepMemory]:
        """Make this the tracker zeroc's executors enter while the block runs."""
        previous = _CURRENT.tracker
        _CURRENT.tracker = self
        try:
            yield self
        finally:
            _CURRENT.tracker = previous


def current_tracker() -> StepMemory | None:
    """The tracker recording the graphs running now (inside ``tracking_scope``), if any."""
    return _CURRENT.tracker if _CURRENT.depth else None


def tracking() -> bool:
    """Whether a tracker is active (a cheap test for the executors' hot path)."""
    return _CURRENT.tracker is not None


@contextlib.contextmanager
def tracking_scope() -> Iterator[None]:
    """Entered by the executors around the graphs they run: the active tracker, if any,
    records what runs inside (entered once however deeply executors nest)."""
    tracker = _CURRENT.tracker
    if tracker is None or _CURRENT.depth:
        yield
        return
    _CURRENT.depth += 1
    try:
        with tracker:
            yield
    finally:
        _CURRENT.depth -= 1
