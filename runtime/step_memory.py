"""Bytes allocated while a step runs, measured the same way on real and on fake tensors.

``StepMemory`` is a ``TorchDispatchMode`` that records every storage an op outputs, with its
size, and a finalizer that subtracts it when the storage is freed; ``peak`` is the most bytes
alive at once among the storages it has seen made. zeroc's executors enter it around
the graphs they run (``tracking_scope``), not around Dynamo's frame (a dispatch mode there
would make Dynamo skip the compiled code), so a compiled step is measured as it runs. On
fake tensors (``zeroc.world.fake_world``) a storage's size is what the real one would be.

The optimizer step is measured too when the caller runs it inside the tracker. A storage made
before the step (parameters) is not counted: the caller adds what it held at rest, and tells
the tracker of those storages (``held``), since an op may give one out (a view of a shard).

Ops dispatched while a ``make_fx`` trace runs (AOTAutograd tracing a stage graph) make no
memory, whichever fake tensors they run on: a tracker skips them.

Storages made without an op, and storages an op resized, are reported here so that every
tracker sees them: ``note_made`` (a replayed graph's outputs, a planned rank's parameter
shards), ``note_transient`` (a replayed graph's working set), ``note_resized`` (a released
or restored parameter). Besides the step's tracker, whole-run ledgers registered with
``ledgers_active`` (``zeroc.world.device_allocations``) hear of them. ``allocation_label`` names
what the running code makes (a gather, a gradient reduction, a graph run), for those ledgers.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from zeroc.runtime.torch_compat import TorchDispatchMode, tree_leaves

__all__ = ["StepMemory", "allocation_label", "current_label", "current_tracker",
           "in_step", "ledgers_active", "note_made", "note_resized", "note_transient", "tracing",
           "tracking", "tracking_scope"]


class _Current(threading.local):
    tracker: StepMemory | None = None
    depth = 0
    label: str | None = None


_CURRENT = _Current()
_LEDGERS: list[StepMemory] = []  # whole-run ledgers, process-wide (``ledgers_active``)


def tracing() -> bool:
    """Whether a ``make_fx`` trace is running: its ops make no memory."""
    return get_proxy_mode() is not None


class StepMemory(TorchDispatchMode):
    """Live bytes and their peak over the storages ops create (see the module docstring)."""

    def __init__(self, device_type: str | None = None) -> None:
        super().__init__()
        # Count only storages on this kind of device (None: every one). A planned CUDA step
        # with optimizer offload counts its device, not the host memory beside it.
        self.device_type = device_type
        self.live = 0
        self.peak = 0
        self._seen: dict[int, int] = {}
        self._held: set[int] = set()  # storages from before the step, counted by the caller

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        if not tracing():
            for value in tree_leaves(out):
                if isinstance(value, torch.Tensor) and not getattr(value, "is_meta", False):
                    self._record(value)
        return out

    def note(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as if an op had just made it (once per storage)."""
        self._record(tensor)

    def held(self, tensors: Any) -> None:
        """The storages of ``tensors`` (a DTensor: its local tensor) exist already: an op
        that gives one out (a view of a parameter) makes nothing new."""
        for tensor in tensors:
            local = getattr(tensor, "_local_tensor", tensor)
            if not isinstance(local, torch.Tensor) or local.is_meta:
                continue
            storage = local.untyped_storage()
            if id(storage) not in self._seen:
                self._seen[id(storage)] = 0
                self._held.add(id(storage))
                weakref.finalize(storage, self._free, id(storage))

    def raise_peak(self, extra: int) -> None:
        """A working set of ``extra`` bytes came and went on top of what is live now."""
        self.peak = max(self.peak, self.live + extra)

    def resized(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage changed size (if this tracker counts it)."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._seen and key not in self._held:
            nbytes = storage.nbytes()
            self.live += nbytes - self._seen[key]
            self._seen[key] = nbytes
            self.peak = max(self.peak, self.live)

    def _record(self, tensor: torch.Tensor) -> int | None:
        """Count ``tensor``'s storage unless it already is; return its bytes if it was new."""
        if self.device_type is not None and tensor.device.type != self.device_type:
            return None
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
            return None
        key = id(storage)
        if key in self._seen:
            return None
        nbytes = storage.nbytes()
        self._seen[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)
        return nbytes

    def _free(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)
        self._held.discard(key)

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


def in_step() -> bool:
    """Whether an executor is running a step's graphs (inside ``tracking_scope``)."""
    return _CURRENT.depth > 0


@contextlib.contextmanager
def tracking_scope() -> Iterator[None]:
    """Entered by the executors around the graphs they run: the active tracker, if any,
    records what runs inside (entered once however deeply executors nest). With a whole-run
    ledger registered the scope is marked even without a tracker (``in_step``)."""
    tracker = _CURRENT.tracker
    enter = tracker is not None and not _CURRENT.depth
    if not enter and not _LEDGERS:
        yield
        return
    _CURRENT.depth += 1
    try:
        with tracker if enter else contextlib.nullcontext():  # type: ignore[attr-defined]
            yield
    finally:
        _CURRENT.depth -= 1


@contextlib.contextmanager
def allocation_label(label: str) -> Iterator[None]:
    """What the code inside makes (``"gather"``, ``"gradient"``, ``"graph"``), for the
    whole-run ledgers; nothing is done when none is registered."""
    if not _LEDGERS:
        yield
        return
    previous = _CURRENT.label
    _CURRENT.label = label
    try:
        yield
    finally:
        _CURRENT.label = previous


def current_label() -> str | None:
    """The innermost ``allocation_label`` in effect on this thread, if any."""
    return _CURRENT.label


@contextlib.contextmanager
def ledgers_active(ledger: StepMemory) -> Iterator[None]:
    """Register a whole-run ledger: it hears of the storages made or resized without an op."""
    _LEDGERS.append(ledger)
    try:
        yield
    finally:
        _LEDGERS.remove(ledger)


def note_made(tensor: torch.Tensor, label: str | None = None) -> None:
    """``tensor``'s storage was made without an op (as an op would have made it): the step's
    tracker (inside ``tracking_scope``) and every whole-run ledger count it."""
    tracker = current_tracker()
    if tracker is not None:
        tracker.note(tensor)
    for ledger in _LEDGERS:
        with allocation_label(label) if label else contextlib.nullcontext():
            ledger.note(tensor)


def note_transient(extra: int) -> None:
    """A working set of ``extra`` bytes came and went without ops (a replayed graph's)."""
    tracker = current_tracker()
    if tracker is not None:
        tracker.raise_peak(extra)
    for ledger in _LEDGERS:
        ledger.raise_peak(extra)


def note_resized(tensor: torch.Tensor) -> None:
    """``tensor``'s storage was resized in place (a parameter released or restored)."""
    tracker = current_tracker()
    if tracker is not None:
        tracker.resized(tensor)
    for ledger in _LEDGERS:
        ledger.resized(tensor)
