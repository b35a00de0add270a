"""Full (unsharded) state dicts of a model that ``zeroc.parallelize`` sharded.

``full_state_dict(model)`` gathers every sharded parameter over its data-parallel group and
returns, on global rank 0, a dict with the original keys, full shapes and fp32 master values
(buffers and replicated tensors are copied as they are); every other rank gets ``{}``. It is
collective: all ranks must call it.

``load_full_state_dict(model, state_dict)`` is the inverse: the full dict is given on rank 0
(other ranks may pass ``None``) or on every rank; each rank keeps its own shard. It is
collective too, and it checks keys and shapes first (on rank 0 when only rank 0 has the dict;
the verdict is shared so every rank raises the same ``ValueError``).

With ``pp > 1`` every pipeline position holds the same parameter set, but only the positions
running a parameter's stage update it: each parameter is broadcast from the first such
position (recorded on the parameter when the pipeline compiles), so the dict holds every
stage's current values.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from zeroc.parallelize import layout_of
from zeroc.runtime.pipeline_executor import PP_SOURCE_ATTR
from zeroc.runtime.zero_ops import ParamShard, shard_of, unshard

__all__ = ["full_state_dict", "load_full_state_dict"]


def _world_and_rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _full_tensor(value: torch.Tensor, record: ParamShard, group_name: str) -> torch.Tensor:
    """The full parameter gathered from this rank's shard ``value`` (collective over dp;
    ``group_name=""`` when ``value`` is the whole flat parameter, as at stage 0)."""
    with torch.no_grad():
        return unshard(value.detach(), record.shape, record.numel, group_name, 3).clone()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather full tensors under their original keys; the dict on rank 0, ``{}`` elsewhere."""
    layout = layout_of(model)
    _, rank = _world_and_rank()
    sharded = layout.by_name() if layout is not None else {}
    # Stage 0 keeps whole flat parameters: reshaping needs no gather.
    group_name = layout.dp_group_name if layout is not None and layout.zero > 0 else ""
    gathered: dict[str, torch.Tensor] = {}
    result: dict[str, torch.Tensor] = {}
    sources = _pipeline_sources(model) if layout is not None and layout.pp > 1 else {}
    for key, value in model.state_dict().items():
        record = sharded.get(key)
        if record is None:
            full = value.detach().clone()
        elif record.name in gathered:
            full = gathered[record.name]
        else:
            full = gathered[record.name] = _full_tensor(value, record, group_name)
        if key in sources:
            full = full.contiguous()
            dist.broadcast(full, src=sources[key])
        if rank == 0:
            result[key] = full
    return result


def _pipeline_sources(model: nn.Module) -> dict[str, int]:
    """Key -> global rank that holds the parameter's up-to-date value (pp > 1).

    A compiled pipeline tags each parameter with the pipeline position of its first stage
    (``_zeroc_pp_source``); the first data-parallel rank of that position is the source.
    """
    layout = layout_of(model)
    sources = {}
    for key, value in model.state_dict(keep_vars=True).items():
        position = getattr(value, PP_SOURCE_ATTR, None)
        if position is not None:
            sources[key] = position * layout.dp
    return sources


def _expected(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[str, ...]]]:
    """Full shape of every key, and every key's interchangeable names (itself, tied aliases)."""
    layout = layout_of(model)
    records = layout.by_name() if layout is not None else {}
    shapes: dict[str, tuple[int, ...]] = {}
    names: dict[str, tuple[str, ...]] = {}
    for key, value in model.state_dict().items():
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
) -> bool:
    """Whether every rank has the dict; raises the same ValueError on every rank if unfit."""
    world, rank = _world_and_rank()
    have = state_dict is not None and len(state_dict) > 0
    everywhere = have
    if world > 1:
        flag = torch.tensor([1 if have else 0], dtype=torch.int64)
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
    only one of its names. Values are converted to each target's dtype and device.
    """
    layout = layout_of(model)
    shapes, names = _expected(model)
    everywhere = _agree_on_source(state_dict, shapes, names)
    _, rank = _world_and_rank()
    sharded = layout.by_name() if layout is not None else {}
    split = layout is not None and layout.zero > 0
    dp = layout.dp if split else 1
    dp_index = layout.mesh.dp_index if split else 0
    loaded: set[str] = set()
    with torch.no_grad():
        for key, target in model.state_dict(keep_vars=True).items():
            if key in loaded:
                continue
            if everywhere or rank == 0:
                source = state_dict[_source_key(state_dict, names[key])]
                full = source.to(device=target.device, dtype=target.dtype).contiguous()
            else:
                full = torch.empty(shapes[key], dtype=target.dtype, device=target.device)
            if not everywhere:
                dist.broadcast(full, src=0)
            record = sharded.get(key)
            target.copy_(shard_of(full, dp, dp_index) if record is not None else full)
            loaded.update(names[key])
