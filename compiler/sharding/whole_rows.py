"""ZeRO-1's whole parameters, kept equal to every rank's rows.

At ZeRO-1 every rank holds the whole parameter (the forward gathers nothing) while the visible
DTensor, the optimizer and state dicts cover only this rank's rows (``Shard(0)``; see
``zeroc.sharding.sharded_params``). Whatever writes the rows leaves the other ranks' copies of
them stale until one all-gather brings every rank's rows to all:

- ``optimizer.step()``: a global optimizer step post-hook (``after_optimizer_step``) gathers
  the parameters the optimizer stepped;
- a load (``load_state_dict``, DCP's ``set_model_state_dict``, or DCP's in-place ``dcp.load``
  into ``model.state_dict()``) or a user's in-place write into the visible parameters:
  ``refresh_stale`` gathers them, from a ``load_state_dict`` post-hook and from the model's
  forward pre-hook, before the graphs read them.

What is stale is read from version counters (``ShardedParam.rows_stamp``): an in-place write
of the rows advances the flat buffer's or the visible parameter's; the gather records both.
Invariant: every rank of a data-parallel group runs the same loads and steps, so the ranks
agree on which groups gather (a group of one dtype gathers all its parameters when any is
stale).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from zeroc.runtime.torch_compat import all_gather_single
from zeroc.sharding.sharded_params import ShardedParam, sharded_of, state_of

__all__ = ["after_optimizer_step", "refresh_after_load", "refresh_stale"]

log = logging.getLogger(__name__)


def _whole_rows(sharded: ShardedParam) -> bool:
    """Whether ``sharded`` is a ZeRO-1 parameter this rank holds rows of."""
    return sharded.record.op_stage == 1 and sharded.placement == "shard" and sharded.held


def gather_whole_rows(params: list[ShardedParam]) -> None:
    """All-gather every rank's rows of ``params`` (one dtype, one group) into their whole
    parameters, and record them as fresh."""
    first = params[0]
    group = first.dp_mesh.get_group()
    dp = group.size()
    pieces, widths = [], []
    for p in params:
        per_rank = -(-p.record.shape[0] // dp) * (p.record.numel // p.record.shape[0])
        local = p.flat.detach()[p.local_offset : p.local_offset + per_rank]
        if local.numel() < per_rank:
            local = torch.nn.functional.pad(local, (0, per_rank - local.numel()))
        pieces.append(local)
        widths.append(per_rank)
    send = torch.cat(pieces)
    recv = send.new_empty(dp * send.numel())
    all_gather_single(recv, send, group=group)
    rows = recv.view(dp, -1)
    offset = 0
    with torch.no_grad():
        for p, width in zip(params, widths, strict=True):
            whole = rows[:, offset : offset + width].reshape(-1)[: p.record.numel]
            p.flat.copy_(whole)
            offset += width
    for p in params:
        p.rows_version = p.rows_stamp()


def _by_group(params: Iterable[ShardedParam]) -> dict[tuple[str, torch.dtype],
                                                       list[ShardedParam]]:
    groups: dict[tuple[str, torch.dtype], list[ShardedParam]] = {}
    for sharded in dict.fromkeys(params):
        if _whole_rows(sharded):
            groups.setdefault((sharded.spec.group_name, sharded.flat.dtype), []).append(sharded)
    return groups


def after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step post-hook: refresh ZeRO-1 parameters from every rank's rows."""
    # A parameter another pipeline stage holds (released here) has no rows on this rank; the
    # ranks of one data-parallel group hold the same stages, so they agree.
    stepped = (sharded_of(param) for group in optimizer.param_groups
               for param in group["params"])
    for params in _by_group(s for s in stepped if s is not None).values():
        gather_whole_rows(params)


def refresh_stale(params: Iterable[ShardedParam], why: str) -> int:
    """Gather the ZeRO-1 parameters among ``params`` whose rows were written since their last
    gather (each group with any stale parameter gathers all of it); how many were stale."""
    stale = 0
    for group in _by_group(params).values():
        count = sum(p.rows_stamp() != p.rows_version for p in group)
        if count:
            log.info("zeroc: ZeRO-1: %d parameter(s) written since the last optimizer step "
                     "(%s): gathering every rank's rows of %d", count, why, len(group))
            gather_whole_rows(group)
            stale += count
    return stale


def refresh_after_load(module: torch.nn.Module, incompatible: Any) -> None:
    """``load_state_dict`` post-hook of a ZeRO-1 model: the loaded rows reach every rank."""
    state = state_of(module)
    if state is not None:
        refresh_stale(state.params, "a state dict was loaded")

