"""ZeRO custom ops ``zeroc::unshard`` / ``zeroc::reduce_grad`` and the sharding arithmetic.

A parameter of ``numel`` elements is flattened, zero-padded to ``padded_numel`` (a multiple of
the data-parallel size ``dp``) and cut into ``dp`` equal contiguous shards; rank ``i`` of the
data-parallel group keeps shard ``i``.

- ``unshard(shard, shape, numel, group_name, zero_stage)`` all-gathers the shards of the group,
  drops the padding and views the result as ``shape``.
- ``reduce_grad(full_grad, padded_numel, group_name, zero_stage)`` is unshard's backward: it
  returns this rank's flat gradient shard averaged over the group (stages 2 and 3:
  reduce-scatter; stage 1: all-reduce then slice, as ZeRO-1 holds full gradients). Stage 0 is
  plain data parallelism: the "shard" is the whole flat parameter, unshard is a reshape and
  reduce_grad an averaging all-reduce.

With ``group_name == ""`` or a group of one rank both ops only reshape (they copy, because a
custom op's output may not alias its input). Both have fake implementations and an autograd
formula, so Dynamo and AOTAutograd trace them as single nodes: the forward graph shows
``zeroc.unshard`` and the backward graph ``zeroc.reduce_grad``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zeroc.runtime.mesh import Mesh, resolve_group

__all__ = [
    "ZERO_STAGES",
    "padded_numel_for",
    "shard_numel_for",
    "shard_of",
    "group_size",
    "group_rank",
]

ZERO_STAGES = (0, 1, 2, 3)

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def padded_numel_for(numel: int, dp: int) -> int:
    """``numel`` rounded up to a multiple of ``dp``."""
    return -(-numel // dp) * dp


def shard_numel_for(numel: int, dp: int) -> int:
    """Elements in each of the ``dp`` shards of a ``numel``-element parameter."""
    return padded_numel_for(numel, dp) // dp


def shard_of(full: torch.Tensor, dp: int, index: int) -> torch.Tensor:
    """A fresh contiguous copy of shard ``index`` of ``full`` split ``dp`` ways (zero padded)."""
    flat = full.detach().reshape(-1)
    padded = padded_numel_for(flat.numel(), dp)
    if padded != flat.numel():
        flat = F.pad(flat, (0, padded - flat.numel()))
    size = padded // dp
    return flat[index * size : (index + 1) * size].clone()


def group_size(group_name: str) -> int:
    """Number of ranks in the named group (1 for the empty name)."""
    group = resolve_group(group_name)
    return 1 if group is None else group.size()


def group_rank(group_name: str) -> int:
    """This process's rank inside the named group (0 for the empty name)."""
    group = resolve_group(group_name)
    return 0 if group is None else dist.get_rank(group)


def _check_stage(op: str, zero_stage: int) -> None:
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zeroc::{op}: zero_stage={zero_stage!r} is not allowed (0, 1, 2 or 3)")


def _ranks_for(group_name: str, zero_stage: int) -> int:
    """How many shards the parameter is cut into: 1 for stage 0 (replicated)."""
    return 1 if zero_stage == 0 else group_size(group_name)


_LIB = torch.library.Library("zeroc", "FRAGMENT")
_LIB.define(
    "unshard(Tensor shard, SymInt[] shape, int numel, str group_name, int zero_stage) -> Tensor"
)
_LIB.define(
    "reduce_grad(Tensor full_grad, int padded_numel, str group_name, int zero_stage) -> Tensor"
)


@torch.library.impl(_LIB, "unshard", "CompositeExplicitAutograd")
def _unshard(
    shard: torch.Tensor, shape: list[int], numel: int, group_name: str, zero_stage: int
) -> torch.Tensor:
    _check_stage("unshard", zero_stage)
    if shard.dim() != 1:
        raise ValueError(f"zeroc::unshard: shard must be 1-D, got shape {tuple(shard.shape)}")
    ranks = _ranks_for(group_name, zero_stage)
    if shard.numel() * ranks < numel:
        raise ValueError(
            f"zeroc::unshard: {ranks} shards of {shard.numel()} elements cannot hold "
            f"numel={numel}"
        )
    if ranks == 1:
        return shard[:numel].view(shape).clone()
    gathered = shard.new_empty(shard.numel() * ranks)
    _all_gather_single(gathered, shard.contiguous(), group=resolve_group(group_name))
    return gathered[:numel].view(shape)


@torch.library.register_fake("zeroc::unshard", lib=_LIB)
def _unshard_fake(
    shard: torch.Tensor, shape: list[int], numel: int, group_name: str, zero_stage: int
) -> torch.Tensor:
    return shard.new_empty(shape)


@torch.library.impl(_LIB, "reduce_grad", "CompositeExplicitAutograd")
def _reduce_grad(
    full_grad: torch.Tensor, padded_numel: int, group_name: str, zero_stage: int
) -> torch.Tensor:
    _check_stage("reduce_grad", zero_stage)
    ranks = _ranks_for(group_name, zero_stage)
    flat = full_grad.reshape(-1)
    if padded_numel % ranks != 0 or padded_numel < flat.numel():
        raise ValueError(
            f"zeroc::reduce_grad: padded_numel={padded_numel} must be a multiple of the group "
            f"size {ranks} and at least the gradient's {flat.numel()} elements"
        )
    # A fresh buffer: the op must not alias its input, and the all-reduce below is in place.
    if padded_numel > flat.numel():
        flat = F.pad(flat, (0, padded_numel - flat.numel()))
    else:
        flat = flat.clone()
    dp = group_size(group_name)
    if dp == 1:
        return flat
    group = resolve_group(group_name)
    if zero_stage in (2, 3):
        shard = flat.new_empty(padded_numel // dp)
        _reduce_scatter_single(shard, flat, op=dist.ReduceOp.SUM, group=group)
        return shard.div_(dp)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat.div_(dp)
    if zero_stage == 0:
        return flat
    size = padded_numel // dp
    index = dist.get_rank(group)
    return flat[index * size : (index + 1) * size].clone()


@torch.library.register_fake("zeroc::reduce_grad", lib=_LIB)
def _reduce_grad_fake(
    full_grad: torch.Tensor, padded_numel: int, group_name: str, zero_stage: int
) -> torch.Tensor:
    return full_grad.new_empty(padded_numel // _ranks_for(group_name, zero_stage))


def _unshard_setup_context(ctx, inputs, output) -> None:
    shard, _shape, _numel, group_name, zero_stage = inputs
    ctx.shard_numel = shard.shape[0]
    ctx.group_name = group_name
    ctx.zero_stage = zero_stage


def _unshard_backward(ctx, grad: torch.Tensor):
    padded = ctx.shard_numel * _ranks_for(ctx.group_name, ctx.zero_stage)
    grad_shard = torch.ops.zeroc.reduce_grad(grad, padded, ctx.group_name, ctx.zero_stage)
    return grad_shard, None, None, None, None


torch.library.register_autograd(
    "zeroc::unshard", _unshard_backward, setup_context=_unshard_setup_context, lib=_LIB
)


def unshard(
    shard: torch.Tensor, shape: tuple[int, ...], numel: int, group_name: str, zero_stage: int
) -> torch.Tensor:
    """Gather the full parameter of ``shape`` from the shards of ``group_name`` (differentiable)."""
    return torch.ops.zeroc.unshard(shard, list(shape), numel, group_name, zero_stage)


def reduce_grad(
    full_grad: torch.Tensor, padded_numel: int, group_name: str, zero_stage: int
) -> torch.Tensor:
    """This rank's flat gradient shard, averaged over the ranks of ``group_name``."""
    return torch.ops.zeroc.reduce_grad(full_grad, padded_numel, group_name, zero_stage)


__all__ += ["unshard", "reduce_grad"]


@dataclasses.dataclass(frozen=True)
class ParamShard:
    """How one model parameter is held on this rank.

    ``name`` is its original state-dict name (first owner), ``tied_names`` the other names of
    the same tensor (e.g. a tied embedding and head), ``param_name`` its name in
    ``model.named_parameters()`` after parallelization (``<module>.parametrizations.<name>
    .original`` when it is behind a parametrization). ``shard_numel`` elements live on this
    rank; at stage 0 the parameter is replicated (``shard_numel == numel``).
    """

    name: str
    param_name: str
    tied_names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    numel: int
    padded_numel: int
    shard_numel: int
    requires_grad: bool

    @property
    def names(self) -> tuple[str, ...]:
        """Every state-dict name of this parameter: ``name`` first, then ``tied_names``."""
        return (self.name, *self.tied_names)


@dataclasses.dataclass(frozen=True)
class ZeroLayout:
    """What ``zeroc.parallelize`` did to a model: the mesh, the stage and every parameter."""

    zero: int
    pp: int
    dp: int
    world: int
    mixed_precision: str | None
    mesh: Mesh
    params: tuple[ParamShard, ...]

    @property
    def dp_group_name(self) -> str:
        """The data-parallel group the parameters are sharded over (``""`` when dp is 1)."""
        return self.mesh.dp_group_name

    def by_name(self) -> dict[str, ParamShard]:
        """Every state-dict name of every parameter (tied aliases included) -> its record."""
        return {name: record for record in self.params for name in record.names}


__all__ += ["ParamShard", "ZeroLayout"]
