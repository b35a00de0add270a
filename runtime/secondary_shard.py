"""hpZ (ZeRO++'s hierarchical partitioning): a second, node-local shard of each gathered weight.

With ``options={"secondary_shard": k}`` a ZeRO-3 model's data-parallel ranks are cut into
groups of ``k`` consecutive ranks (a node, when ``k`` is the GPUs per node and the ranks are
numbered node by node, as torchrun numbers them). The forward gathers each parameter over the
whole data-parallel group, as ZeRO-3 does; right after, each rank keeps its piece of the
gathered weight cut ``k`` ways (``zeroc::secondary_shard``, a copy of ``1/k`` of the weight in
the gather dtype). The backward re-gathers the weight from those pieces over its group of
``k`` ranks (``zeroc::unshard`` over the group), so no backward gather leaves the node;
gradients are still reduce-scattered over the whole data-parallel group.

The secondary pieces are cut from the forward's own gather, so they are refreshed once per
step (per forward) after every optimizer step and every load with no collective of their own
and can never be stale. The layout: the weight flattened and zero-padded to
``padded_numel_for(shape, k)`` elements (whole rows, as the primary shards) in ``k`` equal
pieces; piece ``i`` belongs to the group's ``i``-th rank, so gathering the pieces in group
order gives the padded weight back exactly.

The groups are made here, once per (data-parallel group, ``k``), by
``torch.distributed.new_subgroups_by_enumeration``: group creation is collective, so every
rank of the world makes every group, in the same order (the compile that first asks, which
every rank runs). Each group has its own name, so graphs differ across groups only in that
name: ``comparable_text`` writes it as ``<secondary k>`` for the check that every rank
compiled the same graph.
"""

from __future__ import annotations

import re
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zeroc.runtime import shutdown
from zeroc.runtime.mesh import resolve_group
from zeroc.runtime.zero_ops import group_rank, group_size, padded_numel_for

__all__ = ["SECONDARY_SHARD", "comparable_text", "secondary_group", "secondary_groups",
           "secondary_padded_numel"]

_LIB = torch.library.Library("zeroc", "FRAGMENT")
_LIB.define("secondary_shard(Tensor full, int padded_numel, str group_name) -> Tensor")


@torch.library.impl(_LIB, "secondary_shard", "CompositeExplicitAutograd")
def _secondary_shard(full: torch.Tensor, padded_numel: int, group_name: str) -> torch.Tensor:
    """This rank's piece of ``full`` flattened, zero-padded to ``padded_numel`` and cut into
    as many equal pieces as ``group_name`` has ranks (a fresh tensor)."""
    ranks = group_size(group_name)
    if padded_numel % ranks or padded_numel < full.numel():
        raise ValueError(
            f"zeroc::secondary_shard: padded_numel={padded_numel} must be a multiple of the "
            f"group size {ranks} and at least the weight's {full.numel()} elements")
    width = padded_numel // ranks
    start = group_rank(group_name) * width
    flat = full.reshape(-1)
    piece = flat[start:start + width]
    if piece.numel() < width:
        piece = F.pad(piece, (0, width - piece.numel()))
    return piece.clone()


@torch.library.register_fake("zeroc::secondary_shard", lib=_LIB)
def _secondary_shard_fake(full: torch.Tensor, padded_numel: int,
                          group_name: str) -> torch.Tensor:
    return full.new_empty(padded_numel // group_size(group_name))


SECONDARY_SHARD = torch.ops.zeroc.secondary_shard.default


def secondary_padded_numel(shape: tuple[int, ...], k: int) -> int:
    """Elements of the weight padded so that ``k`` pieces of whole rows hold it."""
    return padded_numel_for(tuple(shape), k)


# (data-parallel group name, k) -> (weak world group, this rank's group's name). A name
# belongs to the world it was made in: group names are reused by later worlds (a planned
# world after another), so only the current world's entries are read.
_MINE: dict[tuple[str, int], tuple[weakref.ref, str]] = {}


def _current(world: weakref.ref) -> bool:
    group = world()
    return (group is not None and dist.is_initialized() and group is dist.group.WORLD
            and not shutdown.is_destroyed(group))


def _forget_destroyed() -> int:
    stale = [key for key, (world, _) in _MINE.items()
             if world() is None or shutdown.is_destroyed(world())]
    for key in stale:
        del _MINE[key]
    return len(stale)


shutdown.on_release(_forget_destroyed)


def secondary_group(dp_group_name: str, k: int) -> str:
    """The name of this rank's group of ``k`` consecutive ranks of ``dp_group_name``.

    Makes every group of every rank of the data-parallel group on first use (collective:
    every rank of the world calls it, in the same order); raises ``ValueError`` when ``k``
    does not divide the group's size. The world's data-parallel group must span the world
    (pp = 1), so that every rank makes the same groups."""
    group = resolve_group(dp_group_name)
    if group is None:
        raise ValueError("zeroc: secondary_shard needs a data-parallel process group")
    key = (dp_group_name, k)
    cached = _MINE.get(key)
    if cached is not None and _current(cached[0]):
        return cached[1]
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) % k or not 1 < k < len(ranks):
        raise ValueError(f"zeroc: secondary_shard={k} must divide the data-parallel size "
                         f"{len(ranks)} and lie between 2 and {len(ranks) - 1}")
    if len(ranks) != dist.get_world_size():
        raise ValueError("zeroc: secondary_shard needs a data-parallel group that spans "
                         f"the world ({len(ranks)} of {dist.get_world_size()} ranks)")
    from zeroc.runtime.torch_compat import disable_current_modes

    blocks = [ranks[i:i + k] for i in range(0, len(ranks), k)]
    with disable_current_modes():  # made while a graph is compiled: real groups
        mine, _ = dist.new_subgroups_by_enumeration(blocks)
    _MINE[key] = (weakref.ref(dist.group.WORLD), mine.group_name)
    return mine.group_name


def secondary_groups() -> dict[str, int]:
    """The name of each secondary group of this rank in the current world -> its size."""
    return {name: k for (_, k), (world, name) in _MINE.items() if _current(world)}


def comparable_text(text: str) -> str:
    """``text`` with each secondary group's name written ``<secondary k>``: the same on every
    rank of a data-parallel group, whose members belong to different secondary groups."""
    for name, k in secondary_groups().items():
        text = re.sub(rf"(['\"]){re.escape(name)}\1", f"'<secondary {k}>'", text)
    return text
