"""The (pp, dp) device mesh built from the default torch.distributed process group.

Global rank ``r`` sits at pipeline position ``r // dp`` and data-parallel index ``r % dp``
(torchtitan's order: the data-parallel ranks of one pipeline position are contiguous). A
data-parallel group holds the ``dp`` ranks of one pipeline position; a pipeline group holds
the ``pp`` ranks that share a data-parallel index.

Without an initialized process group the mesh is a single rank (world 1) and no group exists.
Groups are created once per (default group, pp) and reused: ``torch.distributed.new_group``
is collective, so every rank creates every group in the same order.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["Mesh", "build_mesh", "resolve_group"]


@dataclasses.dataclass(frozen=True)
class Mesh:
    """This rank's place in a (pp, dp) mesh.

    ``dp_group_name`` and ``pp_group_name`` are the registered names of the process groups this
    rank belongs to (resolve them with :func:`resolve_group`); they are ``""`` when the
    corresponding degree is 1, meaning "no communication along this axis".
    """

    world: int
    pp: int
    dp: int
    rank: int
    pp_index: int
    dp_index: int
    dp_group_name: str
    dp_group_ranks: tuple[int, ...]
    pp_group_name: str
    pp_group_ranks: tuple[int, ...]

    def dp_group(self) -> ProcessGroup | None:
        """The data-parallel process group of this rank, or ``None`` when ``dp == 1``."""
        return resolve_group(self.dp_group_name)

    def pp_group(self) -> ProcessGroup | None:
        """The pipeline process group of this rank, or ``None`` when ``pp == 1``."""
        return resolve_group(self.pp_group_name)


def resolve_group(group_name: str) -> ProcessGroup | None:
    """The process group registered under ``group_name``; ``None`` for the empty name."""
    if not group_name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def dp_ranks_of(pp_index: int, pp: int, dp: int) -> tuple[int, ...]:
    """Global ranks of the data-parallel group at pipeline position ``pp_index``."""
    return tuple(pp_index * dp + d for d in range(dp))


def pp_ranks_of(dp_index: int, pp: int, dp: int) -> tuple[int, ...]:
    """Global ranks of the pipeline group with data-parallel index ``dp_index``."""
    return tuple(p * dp + dp_index for p in range(pp))


# (default group object, pp) -> Mesh; the group object is compared by identity so a destroyed
# and re-initialized default group never reuses stale sub-groups.
_MESH_CACHE: dict[int, tuple[object, Mesh]] = {}


def _world_and_rank() -> tuple[int, int, object | None]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0, None
    return dist.get_world_size(), dist.get_rank(), dist.group.WORLD


def build_mesh(pp: int = 1) -> Mesh:
    """Build (or fetch the cached) mesh of ``pp`` pipeline positions over the default group.

    Raises ``ValueError`` when ``pp`` is not a positive integer dividing the world size. Every
    rank must call this with the same ``pp`` (group creation is collective).
    """
    world, rank, world_group = _world_and_rank()
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp={pp!r} is not allowed: pp must be an integer >= 1")
    if world % pp != 0:
        raise ValueError(
            f"pp={pp} is not allowed: pp must divide the world size {world} "
            f"(allowed: {[d for d in range(1, world + 1) if world % d == 0]})"
        )
    cached = _MESH_CACHE.get(pp)
    if cached is not None and cached[0] is world_group and world_group is not None:
        return cached[1]
    dp = world // pp
    pp_index, dp_index = divmod(rank, dp)
    dp_group_name = _create_groups(
        [dp_ranks_of(p, pp, dp) for p in range(pp)], world, rank, dp > 1
    )
    pp_group_name = _create_groups(
        [pp_ranks_of(d, pp, dp) for d in range(dp)], world, rank, pp > 1
    )
    mesh = Mesh(
        world=world,
        pp=pp,
        dp=dp,
        rank=rank,
        pp_index=pp_index,
        dp_index=dp_index,
        dp_group_name=dp_group_name,
        dp_group_ranks=dp_ranks_of(pp_index, pp, dp),
        pp_group_name=pp_group_name,
        pp_group_ranks=pp_ranks_of(dp_index, pp, dp),
    )
    if world_group is not None:
        _MESH_CACHE[pp] = (world_group, mesh)
    return mesh


def _create_groups(
    all_ranks: list[tuple[int, ...]], world: int, rank: int, needed: bool
) -> str:
    """Create one group per rank tuple (collectively, same order everywhere); return ours."""
    if not needed:
        return ""
    if len(all_ranks) == 1 and len(all_ranks[0]) == world:
        return dist.group.WORLD.group_name
    mine = ""
    for ranks in all_ranks:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = group.group_name
    return mine
