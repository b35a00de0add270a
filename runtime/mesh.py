"""The (pp, dp) device mesh built from the default torch.distributed process group.

Global rank ``r`` sits at pipeline position ``r // dp`` and data-parallel index ``r % dp``
(torchtitan's order: the data-parallel ranks of one pipeline position are contiguous). A
data-parallel group holds the ``dp`` ranks of one pipeline position; a pipeline group holds
the ``pp`` ranks that share a data-parallel index.

The groups are those of a ``torch.distributed.device_mesh.DeviceMesh`` with dimensions named
``("pp", "dp")``: the user's own (``parallelize(..., mesh=...)``, any rank order, ``pp`` may be
absent) or one built here with ``init_device_mesh``. The mesh's ``dp`` dimension is also the
mesh of the parameters' DTensors. Without an initialized process group the mesh is a single
rank (world 1), no group and no DeviceMesh exist. A built mesh is cached per (default group,
pp, device type): group creation is collective, so every rank creates every group in the same
order. The cache holds the default group weakly and forgets the meshes of destroyed groups,
and every DeviceMesh used here is released of its destroyed groups at exit
(``zeroc.runtime.shutdown``): nothing keeps a destroyed group and its threads alive.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from zeroc.runtime import shutdown
from zeroc.runtime.nccl_devices import host_group

__all__ = ["Mesh", "build_mesh", "group_device", "resolve_group"]


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
    # The 1-D DeviceMesh of the data-parallel dimension, the mesh of the parameters'
    # DTensors (None without a process group); not part of equality.
    dp_device_mesh: Any = dataclasses.field(default=None, compare=False, repr=False)
    # A group of this rank's pipeline ranks for small host-side exchanges (CPU tensors): the
    # pipeline group itself where it takes CPU tensors, else a gloo group beside it.
    pp_host_group_name: str = ""

    def dp_group(self) -> ProcessGroup | None:
        """The data-parallel process group of this rank, or ``None`` when ``dp == 1``."""
        return resolve_group(self.dp_group_name)

    def pp_group(self) -> ProcessGroup | None:
        """The pipeline process group of this rank, or ``None`` when ``pp == 1``."""
        return resolve_group(self.pp_group_name)

    def pp_host_group(self) -> ProcessGroup | None:
        """The group of this rank's pipeline for CPU tensors (``None`` when ``pp == 1``)."""
        return resolve_group(self.pp_host_group_name)


def is_fake_group(group: ProcessGroup | None) -> bool:
    """Whether ``group`` belongs to a fake process group (``zeroc.world.fake_world``): one
    program stands for every rank and no collective moves values. Read from the group itself,
    so what runs on it needs no planning flag."""
    return group is not None and "fake" in str(dist.get_backend(group)).split(":")[-1]


def resolve_group(group_name: str) -> ProcessGroup | None:
    """The process group registered under ``group_name``; ``None`` for the empty name."""
    if not group_name:
        return None
    from zeroc.runtime.torch_compat import resolve_process_group

    return resolve_process_group(group_name)


def group_device() -> torch.device:
    """The device this rank's tensors live on for the default process group's collectives.

    Decided by what the group can do, not by its backend's name: with
    ``init_process_group()`` and no backend torch reports ``"undefined"`` and configures
    ``"cpu:gloo,cuda:nccl"``. CUDA (the current device, set from ``LOCAL_RANK`` by the
    launcher's script) when the group routes CUDA tensors to NCCL and this process sees a
    GPU; the CPU otherwise (gloo, or no process group). A planned world's fake group says
    the same in its own configuration (``zeroc.world.fake_world``): ``"cpu:fake,cuda:fake"``
    stands for an NCCL world on the planned GPU (fake CUDA's device 0, where no GPU is
    present), ``"cpu:fake"`` for a gloo one."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    get_config = getattr(dist, "get_backend_config", None)
    config = str(get_config()) if get_config is not None else str(dist.get_backend())
    if is_fake_group(dist.group.WORLD):
        return torch.device("cuda", 0) if "cuda:fake" in config else torch.device("cpu")
    if not torch.cuda.is_available():
        return torch.device("cpu")
    # "cpu:gloo,cuda:nccl", "cuda:nccl", or a bare name ("nccl") on older torch: the
    # backend CUDA tensors are routed to, if it is a GPU one (gloo stages them on the CPU).
    routes = dict(part.split(":", 1) for part in config.lower().split(",") if ":" in part)
    cuda_backend = routes.get("cuda", config.strip().lower() if not routes else "")
    if cuda_backend in ("", "gloo", "undefined"):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def dp_ranks_of(pp_index: int, pp: int, dp: int) -> tuple[int, ...]:
    """Global ranks of the data-parallel group at pipeline position ``pp_index``."""
    return tuple(pp_index * dp + d for d in range(dp))


def pp_ranks_of(dp_index: int, pp: int, dp: int) -> tuple[int, ...]:
    """Global ranks of the pipeline group with data-parallel index ``dp_index``."""
    return tuple(p * dp + dp_index for p in range(pp))


# (pp, device type) -> (weak reference to the default group, Mesh); the group object is
# compared by identity so a destroyed and re-initialized default group never reuses stale
# sub-groups, and held weakly so that the cache never keeps a destroyed group alive.
_MESH_CACHE: dict[tuple[int, str], tuple[weakref.ref, Mesh]] = {}


def _forget_destroyed_meshes() -> int:
    """Drop the cached meshes of a destroyed default group; return how many."""
    stale = [key for key, (group, _) in _MESH_CACHE.items()
             if group() is None or shutdown.is_destroyed(group())]
    for key in stale:
        del _MESH_CACHE[key]
    return len(stale)


shutdown.on_release(_forget_destroyed_meshes)


def _world_and_rank() -> tuple[int, int, object | None]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0, None
    return dist.get_world_size(), dist.get_rank(), dist.group.WORLD


def _check_pp(pp: int, world: int) -> None:
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp={pp!r} is not allowed: pp must be an integer >= 1")
    if world % pp != 0:
        raise ValueError(
            f"pp={pp} is not allowed: pp must divide the world size {world} "
            f"(allowed: {[d for d in range(1, world + 1) if world % d == 0]})"
        )


def build_mesh(pp: int = 1, device_mesh: Any = None, device_type: str = "cpu") -> Mesh:
    """This rank's (pp, dp) mesh: from the user's ``device_mesh``, or built (and cached).

    Raises ``ValueError`` when ``pp`` is not a positive integer dividing the world size, or
    when ``device_mesh`` has no ``"dp"`` dimension or disagrees with ``pp``. Every rank must
    call this with the same arguments (group creation is collective).
    """
    world, rank, world_group = _world_and_rank()
    _check_pp(pp, world)
    if device_mesh is not None:
        return _from_device_mesh(device_mesh, pp, world, rank, device_mesh.device_type)
    if world_group is None:
        return Mesh(world=1, pp=1, dp=1, rank=0, pp_index=0, dp_index=0, dp_group_name="",
                    dp_group_ranks=(0,), pp_group_name="", pp_group_ranks=(0,))
    shutdown.release_destroyed_groups()
    cached = _MESH_CACHE.get((pp, device_type))
    if cached is not None and cached[0]() is world_group:
        return cached[1]
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh(device_type, (pp, world // pp), mesh_dim_names=("pp", "dp"))
    mesh = _from_device_mesh(device_mesh, pp, world, rank, device_type)
    _MESH_CACHE[(pp, device_type)] = (weakref.ref(world_group), mesh)
    return mesh


def _host_groups(device_mesh: Any, rank: int) -> str:
    """The name of the group of ``rank``'s pipeline ranks that takes CPU tensors.

    A pipeline checks its ranks' batch shapes on the host before its first transfer of a
    step (``runtime/pipeline/inputs``); an NCCL group takes no CPU tensor, so a gloo group of
    the same ranks is made beside each pipeline group (group creation is collective: every
    rank makes every pipeline's, in the same order). A planned world (the ``fake`` backend,
    one process standing for every rank) makes its own and holds it to the CPU rule
    (``nccl_devices.host_group``)."""
    layout = device_mesh.mesh  # (pp, dp) global ranks
    backend = None if is_fake_group(dist.group.WORLD) else "gloo"
    mine = None
    for d in range(layout.shape[1]):
        ranks = [int(r) for r in layout[:, d].tolist()]
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            mine = group
    host_group(mine)
    return mine.group_name if mine is not None else ""


def _from_device_mesh(device_mesh: Any, pp: int, world: int, rank: int,
                      device_type: str = "cpu") -> Mesh:
    names = tuple(device_mesh.mesh_dim_names or ())
    if "dp" not in names or any(n not in ("pp", "dp") for n in names):
        raise ValueError(
            f"mesh with dimensions {names} is not allowed: zeroc needs a DeviceMesh whose "
            "dimensions are named ('pp', 'dp') or ('dp',), e.g. init_device_mesh('cuda', "
            "(pp, dp), mesh_dim_names=('pp', 'dp'))"
        )
    if device_mesh.size() != world:
        raise ValueError(f"mesh of {device_mesh.size()} ranks is not allowed: it must span "
                         f"the whole world of {world} ranks")
    mesh_pp = device_mesh.size(names.index("pp")) if "pp" in names else 1
    if pp not in (1, mesh_pp):
        raise ValueError(f"pp={pp} is not allowed with a mesh whose 'pp' dimension is "
                         f"{mesh_pp}: pass pp={mesh_pp} or leave pp out")
    dp = device_mesh.size(names.index("dp"))
    dp_mesh = device_mesh["dp"] if len(names) == 2 else device_mesh
    shutdown.track_device_mesh(device_mesh)
    shutdown.track_device_mesh(dp_mesh)
    dp_group = dp_mesh.get_group()
    if "pp" in names:
        pp_group = device_mesh.get_group("pp")
        pp_index, pp_ranks = device_mesh.get_local_rank("pp"), dist.get_process_group_ranks(
            pp_group)
    else:
        pp_group, pp_index, pp_ranks = None, 0, [rank]
    host_name = ""
    if pp_group is not None and mesh_pp > 1:
        host_name = (pp_group.group_name if device_type == "cpu"
                     else _host_groups(device_mesh, rank))
    return Mesh(
        world=world, pp=mesh_pp, dp=dp, rank=rank,
        pp_index=pp_index, dp_index=dp_mesh.get_local_rank(),
        dp_group_name=dp_group.group_name if dp > 1 else "",
        dp_group_ranks=tuple(dist.get_process_group_ranks(dp_group)),
        pp_group_name=pp_group.group_name if pp_group is not None and mesh_pp > 1 else "",
        pp_group_ranks=tuple(pp_ranks),
        dp_device_mesh=dp_mesh,
        pp_host_group_name=host_name,
    )


# By the data-parallel group object, weakly: a group name comes again after
# ``destroy_process_group()``, so a later world must not find an earlier world's mesh.
_HOST_DP_MESHES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def host_dp_mesh(mesh: Mesh) -> Any:
    """A DeviceMesh of ``mesh``'s data-parallel ranks that takes CPU tensors (``None``
    without a process group; pp must be 1): the dp mesh itself when it is a CPU one, else one
    over a gloo group of the same ranks (collective: every rank makes it), declared a host
    group (``nccl_devices.host_group``). Optimizer offload places the visible parameters
    there, so DTensor collectives on them (a gradient norm, a full tensor) never hand CPU
    tensors to an NCCL group. A world-1 group's (dp 1, no group name) is made per call."""
    device_mesh = mesh.dp_device_mesh
    if device_mesh is None:
        return None
    if device_mesh.device_type == "cpu":
        return device_mesh
    key = device_mesh.get_group() if mesh.dp_group_name else None
    cached = _HOST_DP_MESHES.get(key) if key is not None else None
    if cached is not None:
        return cached
    from torch.distributed.device_mesh import DeviceMesh

    from zeroc.runtime.torch_compat import disable_current_modes

    if mesh.pp != 1:
        raise ValueError("a host data-parallel mesh is made for pp=1 only")
    backend = None if is_fake_group(dist.group.WORLD) else "gloo"
    mine = dist.new_group(list(mesh.dp_group_ranks), backend=backend)  # pp=1: every rank
    host_group(mine)
    with disable_current_modes():  # a planned world's fake tensor mode: the mesh is real
        host_mesh = DeviceMesh.from_group(mine, "cpu", mesh_dim_names=("dp",))
    shutdown.track_device_mesh(host_mesh)
    if key is not None:
        _HOST_DP_MESHES[key] = host_mesh
    return host_mesh
