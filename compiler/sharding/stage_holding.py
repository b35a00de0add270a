"""Each pipeline rank keeps only the parameters of its own stages.

``zeroc.parallelize(model, pp=P)`` shards every parameter over the data-parallel group; the
pipeline split is only known when the compiler has cut the graph. ``keep_only`` is then called
with the flat buffers this rank's stages read: every other parameter is *released*.

A released parameter:

- its flat buffer keeps its size, dtype and device (the compiled graphs are traced with it and
  Dynamo's guards check them) but its storage is resized to 0 bytes, so it holds no memory;
  nothing reads it, because no stage of this rank takes it as an input;
- its visible parameter (the same ``nn.Parameter`` object, so an optimizer built before the
  first step still refers to it) no longer views that storage: a DTensor's local tensor becomes
  a ``meta`` tensor of the same shape, a plain tensor becomes an empty tensor. It never gets a
  gradient, so optimizers create no state for it and ``clip_grad_norm_`` skips it;
- ``model.state_dict()`` leaves it out (the ranks of the stage that holds it save it, so
  DCP's save over all ranks still writes the whole model), and ``load_state_dict`` does not
  report it missing.

A meta-device model's parameters are *deferred* from the start (``zeroc.sharding.deferred_init``): a
rank initializes only those its stages need, when the pipeline compiles.

Invariant: a parameter read by no stage at all stays held at pipeline position 0, so a
checkpoint still contains it. Once released a parameter cannot come back: a later pipeline of
the same model that needs it (another ``split_points`` or ``schedule``) raises.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from zeroc.runtime.step_memory import note_resized
from zeroc.sharding.sharded_params import SAVE_SETTINGS, ShardedParam, state_of

__all__ = ["FLAT_SHARDED_ATTR", "all_parameters", "install_state_dict_hooks", "keep_only",
           "sharded_of_flat"]

log = logging.getLogger(__name__)

FLAT_SHARDED_ATTR = "_zeroc_flat_of"  # on a flat buffer: its ShardedParam


def sharded_of_flat(flat: Any) -> ShardedParam | None:
    """The ``ShardedParam`` a flat buffer belongs to (``None`` for any other value)."""
    return getattr(flat, FLAT_SHARDED_ATTR, None) if isinstance(flat, nn.Parameter) else None


def release(sharded: ShardedParam) -> None:
    """Free ``sharded``'s storage; its visible parameter becomes a meta (or empty) tensor."""
    visible = sharded.visible
    with torch.no_grad():
        if sharded.placement == "plain":
            visible.set_(torch.empty(0, dtype=visible.dtype, device=visible.device))
        else:  # a DTensor: its local tensor becomes meta (reading it shows where it is)
            local = visible._local_tensor
            visible._local_tensor = torch.empty(local.shape, dtype=local.dtype, device="meta")
        sharded.flat.untyped_storage().resize_(0)
    note_resized(sharded.flat)
    sharded.held = False


def keep_only(flats: Iterable[nn.Parameter], needed: Iterable[nn.Parameter]) -> int:
    """Release every flat buffer of ``flats`` that is not in ``needed``; return bytes freed.

    Raises if a buffer in ``needed`` was released by an earlier pipeline of the model."""
    needed = list(needed)
    keep = {id(f) for f in needed}
    waiting = [s for f in needed if (s := sharded_of_flat(f)) is not None and not s.held
               and s.deferred is not None]
    for init in {id(s.deferred): s.deferred for s in waiting}.values():
        init.materialize(waiting)  # a meta model: only these are ever initialized here
    lost = [s.record.param_name for f in needed
            if (s := sharded_of_flat(f)) is not None and not s.held]
    if lost:
        raise RuntimeError(
            f"zeroc pipeline: this rank released {lost[:4]} when the model was first compiled "
            "(a rank keeps only its stages' parameters); a later compile of the same model "
            "must use the same split_points and schedule"
        )
    freed = 0
    for flat in flats:
        sharded = sharded_of_flat(flat)
        if sharded is None or id(flat) in keep:
            continue
        if sharded.deferred is not None:  # never initialized here: other ranks hold it
            sharded.deferred.forget(sharded)
        if not sharded.held:
            continue
        freed += flat.untyped_storage().nbytes()
        release(sharded)
    if freed:
        log.info("pipeline: released %.1f MiB of parameters held by other stages",
                 freed / 2**20)
    return freed


def _released_keys(model: nn.Module) -> set[str]:
    keys: set[str] = set()
    for sharded in getattr(state_of(model), "params", ()):
        if not sharded.held:
            keys.add(sharded.record.param_name)
            keys.update(sharded.record.tied_names)
    return keys


def _not_missing(module: nn.Module, incompatible: Any) -> None:
    released = _released_keys(module)
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in released]


def install_state_dict_hooks(model: nn.Module, deferred: Any = None) -> None:
    """Loading a state dict does not report released parameters missing (saving leaves them
    out: ``zeroc.sharding.sharded_params``' module subclasses skip them). ``deferred``: a meta
    model's ``DeferredInit``; a state dict taken or loaded before the pipeline compiled
    initializes every parameter first, so a checkpoint never meets a missing tensor."""
    model.register_load_state_dict_post_hook(_not_missing)
    if deferred is not None:
        model.register_state_dict_pre_hook(
            lambda module, prefix, keep_vars: deferred.materialize_all("state_dict()"))
        model.register_load_state_dict_pre_hook(
            lambda module, *args: deferred.materialize_all("load_state_dict()"))


@contextlib.contextmanager
def all_parameters(model: nn.Module) -> Iterator[None]:
    """Inside the block ``model.state_dict()`` lists released parameters too (for
    ``full_state_dict``, which fetches them from the ranks that hold them)."""
    previous = SAVE_SETTINGS.include_released
    SAVE_SETTINGS.include_released = True
    try:
        yield
    finally:
        SAVE_SETTINGS.include_released = previous
