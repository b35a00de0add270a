"""Tools for dry-running a model's initializers on meta tensors (``zeroc.sharding.meta_init``).

- ``skeleton(model)``: a shallow copy of the module tree, one node per module, whose
  parameters and buffers are meta stand-ins (tied tensors share a stand-in; a parametrized
  module's stand-in is for its shard), so an initializer can run on it touching no real tensor.
- ``swapped(module, tensors)``: for the length of a block, a module's direct tensors are the
  given ones (scratch tensors being filled) and the others meta; one the block re-assigns
  replaces its entry.
- ``WriteTracker``: a dispatch mode recording the storages in-place ops write, which tells
  which initializer writes which tensor; writes to the storages it is told to block (a real
  model's tensors) are skipped.
- ``empty_like(t)``: an uninitialized tensor like ``t``; a parameter stays a parameter.
- ``storage_id(t)``: the identity of a tensor's storage (None when it has none).
"""

from __future__ import annotations

import contextlib
from collections.abc import Container, Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

from zeroc.runtime.torch_compat import TorchDispatchMode

__all__ = ["WriteTracker", "empty_like", "skeleton", "storage_id", "swapped"]


def storage_id(tensor: torch.Tensor) -> int | None:
    """The identity of ``tensor``'s storage, or None for one without (a functional wrapper)."""
    with contextlib.suppress(RuntimeError, NotImplementedError):
        return tensor.untyped_storage()._cdata
    return None


class WriteTracker(TorchDispatchMode):
    """Record the storages in-place ops write; skip writes to storages in ``block``."""

    def __init__(self, block: Container[int] = ()) -> None:
        super().__init__()
        self.block, self.written = block, set[int]()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in ((i, a) for i, a in enumerate(func._schema.arguments) if a.is_write):
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                sid = storage_id(t) if isinstance(t, torch.Tensor) else None
                if sid is not None and sid in self.block:
                    return t  # a real tensor of the model: a dry run must not change it
                self.written.add(sid)
        return func(*args, **kwargs)


def empty_like(t: torch.Tensor, device: torch.device | str = "meta") -> torch.Tensor:
    """An uninitialized (contiguous) tensor like ``t``; a parameter stays a parameter."""
    empty = torch.empty(t.shape, dtype=t.dtype, device=device)
    return nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty


@contextlib.contextmanager
def swapped(target: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``target``'s direct tensors are ``tensors`` (by name), the others meta, in the block; one
    the block re-assigns (``m.w = nn.Parameter(...)``) replaces its entry in ``tensors``."""
    saved = [(table, dict(table)) for table in (target._parameters, target._buffers)]
    for table, old in saved:
        for name, value in old.items():
            if value is not None:
                table[name] = tensors.get(name, value if value.is_meta else empty_like(value))
    try:
        yield
    finally:
        for table, old in saved:
            for name in tensors.keys() & table.keys():
                new = table[name]
                if isinstance(new, torch.Tensor) and new is not tensors[name] and not new.is_meta:
                    tensors[name] = new
            table.clear()
            table.update(old)


def skeleton(model: nn.Module) -> dict[int, nn.Module]:
    """id(module) -> a shallow copy of it whose tensors are meta stand-ins (ties kept)."""
    stand_in: dict[int, torch.Tensor] = {}

    def meta(t: torch.Tensor) -> torch.Tensor:
        return stand_in.setdefault(id(t), empty_like(t))

    nodes: dict[int, nn.Module] = {}
    for module in model.modules():
        node = nodes[id(module)] = object.__new__(parametrize.type_before_parametrizations(module))
        node.__dict__.update(module.__dict__)
        for table in ("_parameters", "_buffers"):
            old = getattr(module, table)
            node.__dict__[table] = {n: t if t is None else meta(t) for n, t in old.items()}
        if parametrize.is_parametrized(module):  # sharded already: stand in for the shard
            for name, plist in module.parametrizations.items():
                node._parameters[name] = meta(plist.original)
    for module in model.modules():
        old = module._modules
        nodes[id(module)].__dict__["_modules"] = {
            n: None if c is None else nodes[id(c)] for n, c in old.items()
        }
    return nodes
