"""Full (unsharded) state dicts of a model that ``zeroc.parallelize`` sharded.

``model.state_dict()`` itself holds the visible parameters (DTensors of the original shapes,
see ``zeroc.parallelize``), so DCP and ``torch.distributed.checkpoint.state_dict`` work on it
directly. These two functions are for a plain, single-file copy:

``full_state_dict(model, cpu_offload=False)`` returns, on global rank 0, a dict with the
original keys, full shapes and fp32 master values (buffers and replicated tensors copied as
they are); every other rank gets ``{}``. It gathers one tensor at a time to rank 0 only, so no
other rank ever holds a full copy; with ``cpu_offload`` each full tensor is moved to the CPU as
soon as it is complete. It is collective: all ranks must call it.

``load_full_state_dict(model, state_dict)`` is the inverse: the full dict is given on rank 0
(other ranks may pass ``None``) or on every rank; each rank keeps its own rows. It is
collective too, and it checks keys and shapes first (on rank 0 when only rank 0 has the dict;
the verdict is shared so every rank raises the same ``ValueError``).

With ``pp > 1`` a pipeline position holds only its stages' parameters once the pipeline has
compiled (``zeroc.sharding.stage_holding``): each parameter is taken from the first position that
holds
it (recorded on the parameter when the pipeline compiles), and loading writes only the
parameters a rank holds.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from zeroc.runtime.pipeline.executor import PP_SOURCE_ATTR
from zeroc.runtime.zero_ops import WHOLE_STAGES, shard_of
from zeroc.sharding.parallelize import layout_of
from zeroc.sharding.sharded_params import ShardedParam, sharded_of
from zeroc.sharding.stage_holding import all_parameters

__all__ = ["full_state_dict", "load_full_state_dict"]


def _every_value(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict(keep_vars=True)`` with the parameters other pipeline ranks hold."""
    with all_parameters(model):
        return model.state_dict(keep_vars=True)


def _world_and_rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _gather_to(sharded: ShardedParam, dst: int) -> torch.Tensor | None:
    """The full parameter on global rank ``dst`` (``None`` elsewhere); collective over dp."""
    flat = sharded.flat.detach()
    record = sharded.record
    if record.op_stage in WHOLE_STAGES:  # whole on every rank (stages 0, 1; 0-d params)
        return flat[: record.numel].view(record.shape).clone()
    group = sharded.dp_mesh.get_group()
    pieces = None
    if dist.get_rank() == dst:
        pieces = [torch.empty_like(flat) for _ in range(group.size())]
    dist.gather(flat.contiguous(), pieces, dst=dst, group=group)
    if pieces is None:
        return None
    return torch.cat(pieces)[: record.numel].view(record.shape)


def full_state_dict(model: nn.Module, cpu_offload: bool = False) -> dict[str, torch.Tensor]:
    """Gather full tensors under their original keys; the dict on rank 0, ``{}`` elsewhere."""
    layout = layout_of(model)
    _, rank = _world_and_rank()
    gathered: dict[int, torch.Tensor | None] = {}
    result: dict[str, torch.Tensor] = {}
    sources = _pipeline_sources(model) if layout is not None and layout.pp > 1 else {}
    for key, value in _every_value(model).items():
        sharded = sharded_of(value)
        source = sources.get(key, 0)
        if sharded is None:
            full = value.detach().clone() if rank == source else None
        elif id(sharded) in gathered:
            full = gathered[id(sharded)]
        else:
            full = None
            if sharded.record.op_stage in WHOLE_STAGES:  # whole on every rank: no gather
                full = _gather_to(sharded, source) if rank == source else None
            elif source in layout.mesh.dp_group_ranks:  # the source's dp group gathers
                full = _gather_to(sharded, source)
            gathered[id(sharded)] = full
        if source != 0:
            full = _send_to_rank0(full, value, source, rank)
        if rank == 0:
            result[key] = full.cpu() if cpu_offload else full
    return result


def _send_to_rank0(full: torch.Tensor | None, like: torch.Tensor, source: int,
                   rank: int) -> torch.Tensor | None:
    """Point-to-point from the pipeline position that holds the value to rank 0."""
    if rank == source:
        dist.send(full.contiguous(), dst=0)
        return None
    if rank == 0:
        record = getattr(sharded_of(like), "record", None)
        shape = record.shape if record is not None else like.shape
        received = torch.empty(shape, dtype=like.dtype, device=_device_of(like))
        dist.recv(received, src=source)
        return received
    return None


def _device_of(value: torch.Tensor) -> torch.device:
    sharded = sharded_of(value)
    return sharded.flat.device if sharded is not None else value.device


def _pipeline_sources(model: nn.Module) -> dict[str, int]:
    """Key -> global rank that holds the parameter's up-to-date value (pp > 1).

    A compiled pipeline tags each parameter with the pipeline position of its first stage
    (``_zeroc_pp_source``); the first data-parallel rank of that position is the source.
    """
    layout = layout_of(model)
    sources = {}
    for key, value in _every_value(model).items():
        sharded = sharded_of(value)
        position = getattr(sharded.flat if sharded else value, PP_SOURCE_ATTR, None)
        if position is not None:
            sources[key] = position * layout.dp
    return sources


def _expected(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[str, ...]]]:
    """Full shape of every key, and every key's interchangeable names (itself, tied aliases)."""
    layout = layout_of(model)
    records = layout.by_name() if layout is not None else {}
    shapes: dict[str, tuple[int, ...]] = {}
    names: dict[str, tuple[str, ...]] = {}
    for key, value in _every_value(model).items():
        record = records.get(key)
        shapes[key] = record.shape if record is not None else tuple(value.shape)
        aliases = record.names if record is not None else ()
        names[key] = (key, *(a for a in aliases if a != key))
    return shapes, names


def _source_key(state_dict: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> str | None:
    return next((name for name in names if name in state_dict), None)


def _check(
    state_dict: Mapping[str, torch.Tensor],
    shapes: dict[str, tuple[int, ...]],
    names: dict[str, tuple[str, ...]],
) -> str:
    """An error message for missing, unexpected or mis-shaped keys; ``""`` when it fits."""
    missing = [k for k in shapes if _source_key(state_dict, names[k]) is None]
    unexpected = [k for k in state_dict if k not in shapes]
    wrong = [
        f"{k}: got {tuple(state_dict[k].shape)}, expected {shapes[k]}"
        for k in shapes
        if k in state_dict and tuple(state_dict[k].shape) != shapes[k]
    ]
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    if wrong:
        problems.append(f"wrong shapes {wrong}")
    if not problems:
        return ""
    return "load_full_state_dict: state_dict does not fit the model: " + "; ".join(problems)


def _agree_on_source(
    state_dict: Mapping[str, torch.Tensor] | None,
    shapes: dict[str, tuple[int, ...]],
    names: dict[str, tuple[str, ...]],
    device: torch.device,
) -> bool:
    """Whether every rank has the dict; raises the same ValueError on every rank if unfit."""
    world, rank = _world_and_rank()
    have = state_dict is not None and len(state_dict) > 0
    everywhere = have
    if world > 1:
        # On the parameters' device: an NCCL group has no CPU backend.
        flag = torch.tensor([1 if have else 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        everywhere = bool(flag.item())
    if everywhere:
        error = _check(state_dict, shapes, names)
    elif world == 1:
        error = "load_full_state_dict: state_dict is empty"
    else:
        message = ["load_full_state_dict: state_dict must be given on rank 0"]
        if rank == 0 and have:
            message = [_check(state_dict, shapes, names)]
        dist.broadcast_object_list(message, src=0)
        error = message[0]
    if error:
        raise ValueError(error)
    return everywhere


def load_full_state_dict(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None
) -> None:
    """Load a full state dict (given on rank 0, or on every rank) into this rank's shards.

    Collective. Keys are the original names (``full_state_dict``'s); a tied parameter needs
    only one of its names. Values are converted to each target's dtype and device. Without
    the dict everywhere, rank 0 broadcasts one tensor at a time.
    """
    layout = layout_of(model)
    shapes, names = _expected(model)
    targets = _every_value(model)
    device = next((_device_of(t) for t in targets.values()), torch.device("cpu"))
    everywhere = _agree_on_source(state_dict, shapes, names, device)
    _, rank = _world_and_rank()
    loaded: set[str] = set()
    with torch.no_grad():
        for key, target in targets.items():
            if key in loaded:
                continue
            sharded = sharded_of(target)
            storage = sharded.flat if sharded is not None else target
            if everywhere or rank == 0:
                source = state_dict[_source_key(state_dict, names[key])]
                full = source.to(device=storage.device, dtype=storage.dtype).contiguous()
            else:
                full = torch.empty(shapes[key], dtype=storage.dtype, device=storage.device)
            if not everywhere:
                dist.broadcast(full, src=0)
            if sharded is not None and not sharded.held:
                loaded.update(names[key])  # held by another pipeline position, which loads it
                continue
            if sharded is None:
                target.copy_(full)
            elif sharded.record.op_stage in WHOLE_STAGES:
                storage.copy_(full.reshape(-1))
            else:
                storage.copy_(shard_of(full, layout.dp, layout.mesh.dp_index))
            if sharded is not None and sharded.host is not None:  # offload: the master too
                sharded.host.copy_(sharded.local_view(storage))
                sharded.rows_version = sharded.rows_stamp()
            loaded.update(names[key])
