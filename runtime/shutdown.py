"""A clean exit: no process group outlives ``torch.distributed.destroy_process_group()``.

``destroy_process_group()`` unregisters the groups, but a gloo group (with its threads: one
``gloo_tcp_loop`` and two ``pt_gloo_runloop`` per group) lives on as long as a Python object
references it. A group still alive when the interpreter is torn down can abort the process
with ``terminate called without an active exception`` (SIGABRT): a gloo worker thread that
drops the last collective's work frees its tensors, takes the GIL to release their Python
objects, finds the interpreter finalizing and is ended by ``pthread_exit``, whose unwinding
through a ``noexcept`` destructor calls ``std::terminate``. So zeroc keeps no group alive itself
and releases what it can find of torch's references to destroyed groups:

- :func:`drop_captured_groups` replaces default arguments that captured a process group
  (``torch.distributed.nn.functional`` declares ``group=group.WORLD``, evaluated when the module
  is first imported, which ``torch.compile`` does after the user's ``init_process_group``);
- :func:`track_device_mesh` remembers (weakly) a ``DeviceMesh`` zeroc uses; its
  ``_pg_registry`` holds its groups strongly, and the parameters' DTensors keep the mesh alive
  as long as the model, usually until the interpreter is torn down;
- :func:`release_destroyed_groups` drops every such reference to a group that is no longer
  registered (destroyed), plus whatever :func:`on_release` registered (zeroc's mesh cache). It
  runs when zeroc builds a mesh and, from an ``atexit`` handler, at exit: atexit handlers run
  while the interpreter is still whole, so freeing the groups there joins gloo's threads
  safely. Groups the user has not destroyed are never touched.
"""

from __future__ import annotations

import atexit
import gc
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "drop_captured_groups",
    "is_destroyed",
    "on_release",
    "release_destroyed_groups",
    "track_device_mesh",
]

_RELEASERS: list[Callable[[], int]] = []
# id(DeviceMesh) -> DeviceMesh, held weakly so that zeroc never keeps a mesh alive.
_DEVICE_MESHES: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def on_release(release: Callable[[], int]) -> None:
    """Have :func:`release_destroyed_groups` call ``release``, which returns what it dropped."""
    if release not in _RELEASERS:
        _RELEASERS.append(release)


def track_device_mesh(device_mesh: Any) -> None:
    """Release ``device_mesh``'s references to its groups once they are destroyed."""
    _DEVICE_MESHES[id(device_mesh)] = device_mesh


def is_destroyed(group: ProcessGroup) -> bool:
    """Whether ``group`` is no longer the group registered under its name."""
    from zeroc.runtime.torch_compat import resolve_process_group

    if not (dist.is_available() and dist.is_initialized()):
        return True
    try:
        return resolve_process_group(group.group_name) is not group
    except (RuntimeError, ValueError):
        return True


def release_destroyed_groups() -> int:
    """Drop every reference zeroc knows of to a destroyed process group; return how many."""
    released = drop_captured_groups()
    for device_mesh in list(_DEVICE_MESHES.values()):
        released += _release_mesh_groups(device_mesh)
    for release in _RELEASERS:
        released += release()
    return released


def _release_mesh_groups(device_mesh: Any) -> int:
    """Forget the destroyed groups a ``DeviceMesh`` (and its root mesh) keeps by name.

    ``DeviceMesh._pg_registry`` holds group objects so that ``torch.compile`` can trace
    ``get_group``; outside compilation groups are looked up by name, and a destroyed group
    cannot be used either way.
    """
    released = 0
    for mesh in (device_mesh, getattr(device_mesh, "_root_mesh", None)):
        registry = getattr(mesh, "_pg_registry", None)
        if not isinstance(registry, dict):
            continue
        for name, group in list(registry.items()):
            if isinstance(group, ProcessGroup) and is_destroyed(group):
                del registry[name]
                released += 1
    return released


def _release_at_exit() -> None:
    if release_destroyed_groups():
        gc.collect()  # free the groups (joining gloo's threads) while the interpreter is whole


_SCANNED: dict[str, types.ModuleType] = {}  # module name -> the module object scanned


def drop_captured_groups() -> int:
    """Replace process groups captured as default arguments in ``torch.distributed`` by ``None``.

    ``torch.distributed.nn.functional`` declares ``def all_reduce(..., group=group.WORLD)``; the
    default is evaluated when the module is first imported, and ``torch.compile`` imports it
    (through ``torch._dynamo``) after the user's ``init_process_group``. Those functions then
    hold the default group for the rest of the process. ``None`` means the default group in
    every ``torch.distributed`` API, so the functions behave as before (and, unlike the
    captured object, still right after a re-initialization). Returns how many were replaced.
    """
    replaced = 0
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        # A default is evaluated once, when its module runs: a module scanned before holds
        # no captured group now (it had none, or they were replaced then).
        if _SCANNED.get(name) is module:
            continue
        if not getattr(getattr(module, "__spec__", None), "_initializing", False):
            _SCANNED[name] = module  # (one still being imported may define more)
        # type(), not isinstance(): some module attributes warn when their class is read.
        for value in list(vars(module).values()):
            kind = type(value)
            if kind is types.FunctionType and value.__module__ == name:
                replaced += _drop_group_defaults(value)
            elif issubclass(kind, type) and value.__module__ == name:
                for member in list(vars(value).values()):
                    if type(member) is types.FunctionType:
                        replaced += _drop_group_defaults(member)
    return replaced


def _drop_group_defaults(function: types.FunctionType) -> int:
    replaced = 0
    defaults = function.__defaults__
    if defaults and any(isinstance(d, ProcessGroup) for d in defaults):
        replaced += sum(isinstance(d, ProcessGroup) for d in defaults)
        function.__defaults__ = tuple(None if isinstance(d, ProcessGroup) else d
                                      for d in defaults)
    keywords = function.__kwdefaults__
    if keywords and any(isinstance(d, ProcessGroup) for d in keywords.values()):
        replaced += sum(isinstance(d, ProcessGroup) for d in keywords.values())
        function.__kwdefaults__ = {k: None if isinstance(d, ProcessGroup) else d
                                   for k, d in keywords.items()}
    return replaced


atexit.register(_release_at_exit)
