"""The gradient norm of a pipelined model, also through torch's own clipping functions.

With ``pp > 1`` a rank holds only its stages' gradients, so the norm of the gradients it sees
is its pipeline position's share. ``pipeline_norm`` adds the positions' norms over the
pipeline group (each gradient's own norm is already global over the data-parallel group: a
DTensor's, or a whole gradient every replica holds alike). A parameter held by two positions
(an embedding tied to the head, held by the first and last stage) is counted only at its
first holder (``PP_SOURCE_ATTR``); a parameter released to other positions has no gradient
here and is not counted.

``register(state)`` (``zeroc.parallelize`` with ``pp > 1``) routes torch's own
``torch.nn.utils.clip_grad_norm_`` and ``torch.nn.utils.get_total_norm`` here: both compute
the norm through ``torch.nn.utils.clip_grad._get_total_norm`` (torch 2.6 on), which is
replaced, once, by ``_routed_total_norm``. It recognises the gradients of a registered
model's parameters by identity (``param.grad is grad``) and returns the pipeline's norm for
them, so ``clip_grad_norm_(model.parameters(), max_norm)`` returns the whole model's norm and
clips every stage by it; any other call goes to torch's function unchanged. A list mixing a
pipelined model's gradients with other tensors raises, naming ``zeroc.clip_grad_norm_``.
Like torch's norm of DTensors, the routed norm is collective: every rank must call it.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist

from zeroc.runtime.mesh import group_device
from zeroc.runtime.pipeline.executor import PP_SOURCE_ATTR
from zeroc.runtime.torch_compat import clip_total_norm, set_clip_total_norm
from zeroc.sharding.sharded_params import ShardedParam, ZeroState

__all__ = ["owned_here", "pipeline_norm", "register"]

log = logging.getLogger(__name__)

LAYOUT_ATTR = "_zeroc_layout"  # on a flat buffer: its model's ZeroLayout (zeroc.parallelize)

# torch's norm of a list of tensors, as torch defines it (taken before any replacement).
_TORCH_TOTAL_NORM = clip_total_norm()
# The ZeroStates of live pipelined models (pp > 1) whose gradients are routed.
_PIPELINED: weakref.WeakSet[ZeroState] = weakref.WeakSet()


def owned_here(sharded: ShardedParam | None, pp_index: int) -> bool:
    """Whether this pipeline position counts the parameter's gradient in the norm: it is its
    first holder (a parameter no pipeline compiled yet: every position)."""
    source = getattr(sharded.flat, PP_SOURCE_ATTR, None) if sharded is not None else None
    return source is None or source == pp_index


def _plain(norm: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else norm


def pipeline_norm(layout, owned: list[torch.Tensor], norm_type: float,
                  error_if_nonfinite: bool = False, foreach: bool | None = None,
                  device: torch.device | None = None) -> torch.Tensor:
    """The norm of order ``norm_type`` of every position's ``owned`` gradients together.

    ``layout``: the model's ``ZeroLayout`` (its mesh names the pipeline group); ``owned``:
    the gradients this position counts; ``device``: where a position owning none puts its
    zero. Collective over the pipeline group (and, for DTensors, their data-parallel group)."""
    norm_type = float(norm_type)
    with torch.no_grad():
        if owned:
            local = _plain(_TORCH_TOTAL_NORM(owned, norm_type, False, foreach))
        else:
            local = torch.zeros((), device=device or group_device())
        group = layout.mesh.pp_group()
        if math.isinf(norm_type):
            total = local.clone()
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            total = local.double() ** norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
            total = (total ** (1.0 / norm_type)).to(local.dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"zeroc: the total gradient norm of order {norm_type} is "
                           f"{total.item()}; set error_if_nonfinite=False to clip anyway")
    return total


def _owners() -> dict[int, ShardedParam]:
    """``id(grad)`` -> its parameter, for every registered model's parameters with one."""
    return {id(s.visible.grad): s for state in list(_PIPELINED) for s in state.params
            if s.visible.grad is not None}


@functools.wraps(_TORCH_TOTAL_NORM)
def _routed_total_norm(tensors: torch.Tensor | Iterable[torch.Tensor], norm_type: float = 2.0,
                       error_if_nonfinite: bool = False,
                       foreach: bool | None = None) -> torch.Tensor:
    """torch's ``get_total_norm``, except for a pipelined model's gradients (module docstring)."""
    if not _PIPELINED:
        return _TORCH_TOTAL_NORM(tensors, norm_type, error_if_nonfinite, foreach)
    listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    owners = _owners()
    params = [owners.get(id(t)) for t in listed]
    if not any(p is not None for p in params):
        return _TORCH_TOTAL_NORM(listed, norm_type, error_if_nonfinite, foreach)
    layouts = {id(getattr(p.flat, LAYOUT_ATTR, None)): getattr(p.flat, LAYOUT_ATTR, None)
               for p in params if p is not None}
    if any(p is None for p in params) or len(layouts) > 1:
        raise ValueError(
            "torch.nn.utils.clip_grad_norm_ / get_total_norm: the gradients mix a pipelined "
            "zeroc model's (pp > 1) with other tensors; pass one model's parameters, or use "
            "zeroc.clip_grad_norm_(model, max_norm)")
    layout = next(iter(layouts.values()))
    index = layout.mesh.pp_index
    owned = [t for t, p in zip(listed, params, strict=True) if owned_here(p, index)]
    return pipeline_norm(layout, owned, norm_type, error_if_nonfinite, foreach,
                         listed[0].device)


def register(state: ZeroState) -> None:
    """Route torch's gradient norm to ``pipeline_norm`` for ``state``'s model (pp > 1)."""
    _PIPELINED.add(state)
    if clip_total_norm() is _TORCH_TOTAL_NORM:
        set_clip_total_norm(_routed_total_norm)
        log.debug("zeroc: torch.nn.utils clip_grad_norm_ / get_total_norm routed for "
                  "pipelined models")
    if torch.nn.utils.get_total_norm is _TORCH_TOTAL_NORM:
        torch.nn.utils.get_total_norm = _routed_total_norm
