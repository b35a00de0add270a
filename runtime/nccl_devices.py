"""NCCL's device rule, checked on a CPU: every tensor a collective or a point-to-point call
is given must be on the group's CUDA device.

ProcessGroupNCCL refuses a CPU tensor ("Tensors must be CUDA and dense"), and a tensor on
another GPU than the one the rank's communicator was made for hangs or corrupts; gloo takes
either, so tests on gloo cannot see the fault. ``StrictDevices`` is a ``TorchDispatchMode``
that sees every c10d operator (``dist.all_reduce``, ``dist.batch_isend_irecv``, ...,
``torch.ops.c10d.*``) and every functional collective a compiled graph runs
(``torch.ops._c10d_functional.*``), and raises ``CollectiveDeviceError`` for a tensor not on
the group's device, naming the operator, the tensor (shape, dtype, device), the group and the
call site: the first Python frame outside torch (zeroc's or the user's code).

The planned world (``zeroc.world.fake_world``) runs every rank's real program under it on fake
CUDA tensors, so a CPU tensor reaching a collective anywhere on that path fails there. It is
a mode Dynamo compiles through (``ignore_compile_internals``): ops Dynamo traces on its own
fake tensors are checked too, which is the same fault one step earlier.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from zeroc.runtime.torch_compat import TorchDispatchMode, resolve_process_group, tree_leaves

__all__ = ["CollectiveDeviceError", "StrictDevices", "active_check", "call_site", "host_group",
           "strict_devices"]

# The operator namespaces whose tensors cross the network.
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd",
                                    "_dtensor"})
# c10d operators that move no tensor data of the caller's (their tensors are the work's).
_EXEMPT = frozenset({"wait_tensor", "monitored_barrier_"})
_TORCH_DIR = os.path.dirname(torch.__file__)
# Groups made for host-side exchanges (gloo beside NCCL), which take CPU tensors only: by
# name, held weakly (group names are reused once a world is destroyed and another made).
_HOST_GROUPS: dict[str, weakref.ref] = {}


def host_group(group: Any) -> None:
    """Declare ``group`` (a ``ProcessGroup``) a host group: it takes CPU tensors only."""
    if group is not None:
        _HOST_GROUPS[group.group_name] = weakref.ref(group)


def _is_host(name: str, group: Any) -> bool:
    ref = _HOST_GROUPS.get(name)
    if ref is None:
        return False
    if group is None:  # a functional collective names its group: resolve it
        try:
            group = resolve_process_group(name)
        except (RuntimeError, ValueError, KeyError):
            return False
    return ref() is group


class CollectiveDeviceError(RuntimeError):
    """A collective or point-to-point call was given a tensor off the group's device."""


def call_site() -> str:
    """``file:line (function)`` of the innermost Python frame outside torch and this module."""
    frame = sys._getframe(1)
    here = os.path.abspath(__file__)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_TORCH_DIR) and path != here and "contextlib" not in path:
            return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "<torch internals>"


def _group_of(args: Any, kwargs: Any) -> tuple[str, Any]:
    """The group a c10d call names: a ``ProcessGroup`` argument (its name and itself), or a
    functional collective's group-name string (and ``None``)."""
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.ScriptObject):  # a c10d op's boxed ProcessGroup
            try:
                value = dist.ProcessGroup.unbox(value)
            except (RuntimeError, TypeError):
                continue
        name = getattr(value, "group_name", None)
        if isinstance(name, str):
            return name, value
    for value in args:
        if isinstance(value, str) and value:
            return value, None
    return "the default group", None


def _describe(tensor: torch.Tensor) -> str:
    return (f"a {str(tensor.dtype).removeprefix('torch.')} tensor of shape "
            f"{list(tensor.shape)} on {tensor.device}")


class StrictDevices(TorchDispatchMode):
    """Raise ``CollectiveDeviceError`` when a collective's tensor is not on ``device``.

    ``device``: the rank's CUDA device (its communicator's); a device without an index
    matches any index of its type."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.checked = 0  # collective calls seen, for tests that must see some

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # Dynamo compiles through this mode (it only reads devices)

    def _on_device(self, tensor: torch.Tensor) -> bool:
        device = tensor.device
        if device.type != self.device.type:
            return False
        return self.device.index is None or device.index in (None, self.device.index)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if (func.namespace in _COLLECTIVE_NAMESPACES
                and func.__name__.split(".")[0] not in _EXEMPT):
            self.checked += 1
            group, process_group = _group_of(args, kwargs)
            host = _is_host(group, process_group)
            for value in tree_leaves((args, kwargs)):
                if not isinstance(value, torch.Tensor):
                    continue
                if host and value.device.type != "cpu":
                    raise CollectiveDeviceError(
                        f"zeroc: {func} on the host group {group!r} was given "
                        f"{_describe(value)}, at {call_site()}; a gloo group takes CPU "
                        "tensors")
                if not host and not self._on_device(value):
                    raise CollectiveDeviceError(
                        f"zeroc: {func} on group {group!r} was given "
                        f"{_describe(value)}, at {call_site()}; NCCL takes only tensors on "
                        f"the rank's device ({self.device}): move it there first "
                        "(tensor.to(device)) or make it there")
        return func(*args, **kwargs)


class _Active(threading.local):
    mode: StrictDevices | None = None


_ACTIVE = _Active()


def active_check() -> StrictDevices | None:
    """The check running on this thread (inside ``strict_devices``), if any."""
    return _ACTIVE.mode


@contextlib.contextmanager
def strict_devices(device: torch.device) -> Iterator[StrictDevices]:
    """Check every collective this thread runs inside the block against ``device`` (nested
    calls reuse the outer check)."""
    if _ACTIVE.mode is not None:
        yield _ACTIVE.mode
        return
    mode = StrictDevices(device)
    _ACTIVE.mode = mode
    try:
        with mode:
            yield mode
    finally:
        _ACTIVE.mode = None
