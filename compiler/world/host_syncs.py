"""Count the points where the host would wait for a CUDA device, with their call sites.

A training step that never makes the host wait for the GPU lets the host queue the next
kernels while the device computes; every ``.item()``, every blocking copy between the host
and the device and every explicit synchronization drains that queue. ``count_host_syncs()``
records each of them while it is active::

    with count_host_syncs() as syncs:
        loss = compiled(x, y)
        loss.backward()
    assert not syncs, syncs   # [HostSync(what="aten._local_scalar_dense", site="...:62 (f)")]

What counts (on tensors of ``device_type``, ``"cuda"`` by default):

- a value read on the host: ``aten._local_scalar_dense`` (``.item()``, ``float()``,
  ``int()``, ``bool()``, ``if t:``), ``aten.equal``, ``Tensor.tolist()``;
- a copy between the host and the device without ``non_blocking=True`` (``.cpu()``,
  ``.to("cpu")``, ``.to("cuda")`` of a CPU tensor, ``copy_``): torch synchronizes the stream
  after such a copy, in both directions;
- an op whose output shape depends on the values (``nonzero``, ``masked_select``,
  ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``, indexing with a
  boolean mask);
- ``torch.cuda.synchronize``, ``torch.accelerator.synchronize``, ``Stream.synchronize``,
  ``Event.synchronize``, and ``Event.elapsed_time`` of an end event that neither
  ``Event.query()`` (returning true) nor ``Event.synchronize`` showed complete (torch raises
  on an incomplete one, so the code relied on some other wait).

The call site is the first Python frame outside torch and this module (``path:line (function)``).

Ops are seen by a ``TorchDispatchMode`` that ``torch.compile`` lets through
(``ignore_compile_internals``): compiled code runs compiled, and the ops of zeroc's graphs
and executors reach the mode. The ``torch.cuda`` functions are patched while the counter is
active and restored when it exits. Nothing is changed: a read on a fake tensor (the planned
world has no values) still raises as it would without the counter, after it was counted. On
a torch without a usable CUDA device the patched functions count and return what a device
with nothing queued would (``synchronize``: nothing, ``query``: true, ``elapsed_time``: 0).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from zeroc.runtime.torch_compat import FakeTensor, TorchDispatchMode, tree_leaves

__all__ = ["HostSync", "count_host_syncs"]

log = logging.getLogger(__name__)

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)

_aten = torch.ops.aten
# Output shapes that depend on the values: the host reads a size back from the device.
_DATA_DEPENDENT = {
    _aten.nonzero.default, _aten.masked_select.default, _aten._unique.default,
    _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default,
    _aten.bincount.default, _aten.repeat_interleave.Tensor,
}
_READS = {_aten._local_scalar_dense.default, _aten.equal.default}
_MASK_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default}


class HostSync(NamedTuple):
    """One point where the host would wait for the device: what, and the Python call site."""

    what: str
    site: str


def _call_site() -> str:
    """``path:line (function)`` of the innermost frame outside torch and this module."""
    frame = sys._getframe(1)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(_TORCH_DIR) and name != _THIS_FILE and "<frozen" not in name:
            cwd = os.getcwd() + os.sep
            shown = name[len(cwd):] if name.startswith(cwd) else os.sep.join(
                name.split(os.sep)[-2:])
            return f"{shown}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "<unknown>"


def _on(value: Any, device_type: str) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == device_type


def _copy_device(func: Any, args: tuple, kwargs: dict) -> torch.device | None:
    """The destination device of a ``_to_copy`` / ``copy_`` (None for other ops)."""
    if func is _aten._to_copy.default:
        device = kwargs.get("device")
        return torch.device(device) if device is not None else None
    if func is _aten.copy_.default:
        return args[0].device
    return None


class _SyncMode(TorchDispatchMode):
    """Records every op that would make the host wait for a ``device_type`` tensor."""

    def __init__(self, found: list[HostSync], device_type: str) -> None:
        super().__init__()
        self.found, self.device_type = found, device_type
        self.muted = False  # inside a call already counted (``Tensor.tolist``)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled code stays compiled while the counter is on

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = None if self.muted else self._sync(func, args, kwargs)
        if what is not None:
            self.found.append(HostSync(what, _call_site()))
            log.debug("host sync: %s at %s", *self.found[-1])
        return func(*args, **kwargs)

    def _sync(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        device = self.device_type
        if func in _READS or func in _DATA_DEPENDENT:
            return f"aten.{func.__name__.split('.')[0]}" if any(
                _on(a, device) for a in tree_leaves(args)) else None
        destination = _copy_device(func, args, kwargs)
        if destination is not None:
            source = args[1] if func is _aten.copy_.default else args[0]
            if not isinstance(source, torch.Tensor) or kwargs.get(
                    "non_blocking", args[2] if len(args) > 2 else False):
                return None
            if source.device.type == device and destination.type == "cpu":
                return f"copy {device} -> cpu"
            if source.device.type == "cpu" and destination.type == device:
                return f"copy cpu -> {device}"
            return None
        if func in _MASK_INDEXING:
            indices = args[1] if len(args) > 1 else ()
            if _on(args[0], device) and any(
                    isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                    for i in (indices or ())):
                return f"aten.{func.__name__.split('.')[0]} with a boolean mask"
        return None


def _patched(found: list[HostSync], device_type: str,
             mode: _SyncMode) -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for the host-side waits ``count_host_syncs`` patches."""
    available = torch.cuda.is_available()
    complete: set[int] = set()  # ids of events query() or synchronize() showed complete

    def note(what: str) -> None:
        found.append(HostSync(what, _call_site()))

    def counting(what: str, original: Any, idle: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            note(what)
            return original(*args, **kwargs) if available else idle
        return wrapper

    event_sync, query, elapsed = (torch.cuda.Event.synchronize, torch.cuda.Event.query,
                                  torch.cuda.Event.elapsed_time)

    def synchronize_event(self: Any) -> None:
        note("torch.cuda.Event.synchronize")
        complete.add(id(self))
        return event_sync(self) if available else None

    def query_event(self: Any) -> bool:
        done = query(self) if available else True
        if done:
            complete.add(id(self))
        return done

    def elapsed_time(self: Any, end: Any) -> float:
        if id(end) not in complete:
            note("torch.cuda.Event.elapsed_time of an event not known to be complete")
        return elapsed(self, end) if available else 0.0

    patches = [
        (torch.cuda, "synchronize", counting("torch.cuda.synchronize",
                                             torch.cuda.synchronize, None)),
        (torch.cuda.Stream, "synchronize", counting("torch.cuda.Stream.synchronize",
                                                    torch.cuda.Stream.synchronize, None)),
        (torch.cuda.Event, "synchronize", synchronize_event),
        (torch.cuda.Event, "query", query_event),
        (torch.cuda.Event, "elapsed_time", elapsed_time),
    ]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        patches.append((accelerator, "synchronize", counting(
            "torch.accelerator.synchronize", accelerator.synchronize, None)))
    for cls in (torch.Tensor, FakeTensor):  # a fake tensor has its own
        patches.append((cls, "tolist", _counted_tolist(cls.tolist, device_type, note, mode)))
    return patches


def _counted_tolist(tolist: Any, device_type: str, note: Any, mode: _SyncMode) -> Any:
    def counted(self: torch.Tensor) -> Any:
        if self.device.type != device_type or mode.muted:
            return tolist(self)
        note("Tensor.tolist")
        mode.muted = True  # its copy or element reads are this one sync
        try:
            return tolist(self)
        finally:
            mode.muted = False
    return counted


@contextlib.contextmanager
def count_host_syncs(device_type: str = "cuda") -> Iterator[list[HostSync]]:
    """A list that collects a ``HostSync(what, site)`` for every host synchronization with a
    ``device_type`` device while the block runs (see the module docstring)."""
    found: list[HostSync] = []
    mode = _SyncMode(found, device_type)
    patches = _patched(found, device_type, mode)
    saved = [(owner, name, owner.__dict__.get(name, _MISSING)) for owner, name, _ in patches]
    try:
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)
        with mode:
            yield found
    finally:
        for owner, name, original in reversed(saved):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        if found:
            log.debug("%d host synchronizations counted", len(found))


_MISSING = object()
