"""ZeRO custom ops ``zeroc::unshard`` / ``zeroc::reduce_grad`` and the sharding arithmetic.

A sharded parameter of shape ``(d0, *rest)`` is cut along dimension 0 as FSDP2 and DTensor's
``Shard(0)`` cut it: each of the ``dp`` ranks owns ``c = ceil(d0 / dp)`` rows (the last ranks
fewer, possibly none). Each rank keeps its rows in a flat buffer of ``c * prod(rest)``
elements, zero-padded at the end, so every rank holds a buffer of the same size and the
collectives run on equal flat pieces: rank ``i``'s buffer is elements ``[i*s, (i+1)*s)`` of the
parameter flattened and zero-padded to ``padded_numel = dp * s`` elements. A 1-D parameter is
the special case of rows of one element. The rank's real rows (its DTensor's local tensor)
are a view of the front of that buffer.

- ``unshard(shard, shape, numel, group_name, zero_stage, param_dtype, reduce_dtype)`` casts
  the flat shard to ``param_dtype`` (when given: mixed precision gathers in the compute
  dtype), all-gathers the shards of the group, drops the padding and views the result as
  ``shape``.
- Its backward casts the full gradient to ``reduce_dtype`` (when given), calls ``reduce_grad``
  and returns the result in the shard's own dtype (``reduce_full_grad``, which also reduces
  the sum of gradients accumulated without synchronisation), so a float32 master shard receives a
  gradient reduced in float32 without an intermediate rounding.
- ``reduce_grad(full_grad, padded_numel, group_name, zero_stage)`` returns this rank's flat
  gradient shard averaged over the group (stages 2 and 3: reduce-scatter). Stage 0 is plain
  data parallelism: the "shard" is the whole flat parameter, unshard is a reshape and
  reduce_grad an averaging all-reduce. Stage 1 (ZeRO-1 as DeepSpeed defines it) keeps the
  whole parameter, so unshard is a reshape with no collective, but reduces the gradient by a
  reduce-scatter of its row-padded buffer (``padded_numel``: ``padded_numel_for``): only this
  rank's rows are averaged, which is all its optimizer updates. The result has the whole
  parameter's size (the gradient of a whole flat buffer), this rank's rows in place and
  zeros elsewhere (``zeroc::whole_from_shard``); ``zeroc.sharding.sharded_params`` keeps
  only the rows and all-gathers the updated rows after ``optimizer.step()``. A step moves
  what DDP's all-reduce moves (a reduce-scatter and an all-gather), not an all-reduce and
  an all-gather.

With ``group_name == ""`` or a group of one rank both ops only reshape (they copy, because a
custom op's output may not alias its input). Both have fake implementations and an autograd
formula, so Dynamo and AOTAutograd trace them as single nodes: the forward graph shows
``zeroc.unshard`` and the backward graph ``zeroc.reduce_grad``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zeroc.runtime.mesh import resolve_group
from zeroc.runtime.torch_compat import all_gather_single, reduce_scatter_single

__all__ = [
    "ZERO_STAGES",
    "padded_numel_for",
    "shard_numel_for",
    "rows_per_shard",
    "row_numel",
    "local_rows_for",
    "shard_of",
    "group_size",
    "group_rank",
]

ZERO_STAGES = (0, 1, 2, 3)


def rows_per_shard(shape: tuple[int, ...], dp: int) -> int:
    """Rows of dimension 0 each rank's buffer holds: ``ceil(shape[0] / dp)``."""
    return -(-shape[0] // dp)


def row_numel(shape: tuple[int, ...]) -> int:
    """Elements in one row (one index of dimension 0) of a parameter of ``shape``."""
    return math.prod(shape[1:])


def shard_numel_for(shape: tuple[int, ...], dp: int) -> int:
    """Elements in each rank's (padded) flat buffer of a parameter of ``shape``."""
    return rows_per_shard(shape, dp) * row_numel(shape)


def padded_numel_for(shape: tuple[int, ...], dp: int) -> int:
    """The parameter's element count padded so that ``dp`` equal buffers hold it."""
    return dp * shard_numel_for(shape, dp)


def local_rows_for(shape: tuple[int, ...], dp: int, index: int) -> int:
    """Real rows rank ``index`` owns (``torch.chunk``'s and DTensor ``Shard(0)``'s split)."""
    per = rows_per_shard(shape, dp)
    return max(0, min(shape[0], per * (index + 1)) - per * index)


def shard_of(full: torch.Tensor, dp: int, index: int) -> torch.Tensor:
    """A fresh flat copy of rank ``index``'s buffer of ``full`` split ``dp`` ways by rows."""
    shape = tuple(full.shape)
    flat = full.detach().reshape(-1)
    size = shard_numel_for(shape, dp)
    piece = flat[index * size : (index + 1) * size]
    if piece.numel() < size:
        piece = F.pad(piece, (0, size - piece.numel()))
    return piece.clone()


def group_size(group_name: str) -> int:
    """Number of ranks in the named group (1 for the empty name)."""
    group = resolve_group(group_name)
    return 1 if group is None else group.size()


def group_rank(group_name: str) -> int:
    """This process's rank inside the named group (0 for the empty name)."""
    group = resolve_group(group_name)
    return 0 if group is None else dist.get_rank(group)


# Stages the ops take: 0 (whole, gradients all-reduced), 1 (whole, gradients
# reduce-scattered into this rank's rows) or 2 and 3 (sharded, gradients reduce-scattered).
OP_STAGES = (0, 1, 2, 3)
WHOLE_STAGES = (0, 1)  # the flat buffer is the whole parameter on every rank


def _check_stage(op: str, zero_stage: int) -> None:
    if zero_stage not in OP_STAGES:
        raise ValueError(
            f"zeroc::{op}: zero_stage={zero_stage!r} is not allowed (0, 1, 2 or 3)")


def _ranks_for(group_name: str, zero_stage: int) -> int:
    """How many shards the flat buffer is cut into: 1 for stages 0 and 1 (whole)."""
    return 1 if zero_stage in WHOLE_STAGES else group_size(group_name)


def _reduced_by(group_name: str, zero_stage: int) -> int:
    """How many ranks' rows a gradient is reduce-scattered into: 1 for stage 0 (all-reduce)."""
    return 1 if zero_stage == 0 else group_size(group_name)


_LIB = torch.library.Library("zeroc", "FRAGMENT")
_LIB.define(
    "unshard(Tensor shard, SymInt[] shape, int numel, str group_name, int zero_stage, "
    "ScalarType? param_dtype=None, ScalarType? reduce_dtype=None) -> Tensor"
)
_LIB.define(
    "reduce_grad(Tensor full_grad, int padded_numel, str group_name, int zero_stage) -> Tensor"
)
_LIB.define("whole_from_shard(Tensor shard, int numel, str group_name) -> Tensor")


@torch.library.impl(_LIB, "whole_from_shard", "CompositeExplicitAutograd")
def _whole_from_shard(shard: torch.Tensor, numel: int, group_name: str) -> torch.Tensor:
    """A flat tensor of ``numel`` elements: zeros, with this rank's ``shard`` (its rows of a
    row-padded buffer) at the rank's offset, cut off at ``numel``."""
    whole = shard.new_zeros(numel)
    start = group_rank(group_name) * shard.numel()
    end = min(numel, start + shard.numel())
    if end > start:
        whole[start:end] = shard[: end - start]
    return whole


@torch.library.register_fake("zeroc::whole_from_shard", lib=_LIB)
def _whole_from_shard_fake(shard: torch.Tensor, numel: int, group_name: str) -> torch.Tensor:
    return shard.new_empty(numel)


WHOLE_FROM_SHARD = torch.ops.zeroc.whole_from_shard.default


@torch.library.impl(_LIB, "unshard", "CompositeExplicitAutograd")
def _unshard(
    shard: torch.Tensor, shape: list[int], numel: int, group_name: str, zero_stage: int,
    param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
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
    if param_dtype is not None:
        shard = shard.to(param_dtype)
    if ranks == 1:
        return shard[:numel].view(shape).clone()
    gathered = shard.new_empty(shard.numel() * ranks)
    all_gather_single(gathered, shard.contiguous(), group=resolve_group(group_name))
    return gathered[:numel].view(shape)


@torch.library.register_fake("zeroc::unshard", lib=_LIB)
def _unshard_fake(
    shard: torch.Tensor, shape: list[int], numel: int, group_name: str, zero_stage: int,
    param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return shard.new_empty(shape, dtype=param_dtype or shard.dtype)


@torch.library.impl(_LIB, "reduce_grad", "CompositeExplicitAutograd")
def _reduce_grad(
    full_grad: torch.Tensor, padded_numel: int, group_name: str, zero_stage: int
) -> torch.Tensor:
    _check_stage("reduce_grad", zero_stage)
    ranks = _reduced_by(group_name, zero_stage)
    flat = full_grad.reshape(-1)
    numel = flat.numel()
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
        return flat[:numel] if zero_stage == 1 else flat
    group = resolve_group(group_name)
    if zero_stage > 0:
        shard = flat.new_empty(padded_numel // dp)
        reduce_scatter_single(shard, flat, op=dist.ReduceOp.SUM, group=group)
        shard.div_(dp)
        return _whole_from_shard(shard, numel, group_name) if zero_stage == 1 else shard
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    return flat.div_(dp)


@torch.library.register_fake("zeroc::reduce_grad", lib=_LIB)
def _reduce_grad_fake(
    full_grad: torch.Tensor, padded_numel: int, group_name: str, zero_stage: int
) -> torch.Tensor:
    if zero_stage == 1:  # the whole parameter's size
        return full_grad.new_empty(full_grad.numel())
    return full_grad.new_empty(padded_numel // _ranks_for(group_name, zero_stage))


def _unshard_setup_context(ctx, inputs, output) -> None:
    shard, shape, _numel, group_name, zero_stage, _param_dtype, reduce_dtype = inputs
    ctx.shape = tuple(shape)
    ctx.shard_numel = shard.shape[0]
    ctx.shard_dtype = shard.dtype
    ctx.group_name = group_name
    ctx.zero_stage = zero_stage
    ctx.reduce_dtype = reduce_dtype


def reduce_full_grad(
    grad: torch.Tensor, shape: tuple[int, ...], shard_numel: int, shard_dtype: torch.dtype,
    group_name: str, zero_stage: int, reduce_dtype: torch.dtype | None,
) -> torch.Tensor:
    """The flat shard gradient (in ``shard_dtype``) of a full-shape gradient ``grad``: cast to
    ``reduce_dtype`` when given, then ``reduce_grad``: ``unshard``'s backward, and the reduction
    of the sum accumulated without synchronisation (``zeroc.sharding.sharded_params``)."""
    if zero_stage == 1:  # whole buffer, reduce-scattered by rows
        padded = padded_numel_for(shape, group_size(group_name))
    else:
        padded = shard_numel * _ranks_for(group_name, zero_stage)
    if reduce_dtype is not None:
        grad = grad.to(reduce_dtype)
    grad_shard = torch.ops.zeroc.reduce_grad(grad, padded, group_name, zero_stage)
    return grad_shard.to(shard_dtype)


def _unshard_backward(ctx, grad: torch.Tensor):
    grad_shard = reduce_full_grad(grad, ctx.shape, ctx.shard_numel, ctx.shard_dtype,
                                  ctx.group_name, ctx.zero_stage, ctx.reduce_dtype)
    return grad_shard, None, None, None, None, None, None


torch.library.register_autograd(
    "zeroc::unshard", _unshard_backward, setup_context=_unshard_setup_context, lib=_LIB
)


def unshard(
    shard: torch.Tensor, shape: tuple[int, ...], numel: int, group_name: str, zero_stage: int,
    param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Gather the full parameter of ``shape`` from the shards of ``group_name`` (differentiable;
    gathered in ``param_dtype``, its gradient reduced in ``reduce_dtype`` when given)."""
    return torch.ops.zeroc.unshard(
        shard, list(shape), numel, group_name, zero_stage, param_dtype, reduce_dtype
    )


def reduce_grad(
    full_grad: torch.Tensor, padded_numel: int, group_name: str, zero_stage: int
) -> torch.Tensor:
    """This rank's flat gradient shard, averaged over the ranks of ``group_name``."""
    return torch.ops.zeroc.reduce_grad(full_grad, padded_numel, group_name, zero_stage)


__all__ += ["OP_STAGES", "WHOLE_FROM_SHARD", "WHOLE_STAGES", "reduce_full_grad", "reduce_grad",
            "unshard"]
