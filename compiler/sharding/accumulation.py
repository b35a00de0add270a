"""The step that ends a gradient accumulation at pp=1: every sum reduced once, in buckets.

While gradient synchronisation is off (``set_requires_gradient_sync(False)``), each trainable
parameter has an open "sink" (``ShardedParam.sink``): a zero-stride leaf of the full shape that
the forward adds to every gathered copy of the weight, so autograd sums the gradients of all
its uses there, unreduced. The sink's post-accumulate hook fires once per backward, after the
engine has summed every use's gradient (a tied embedding's three owners, a block applied
twice, a read that only asked for ``.device``): the sum is complete whatever the model does.

When that hook finds the switch on again (the backward of the step that ends the
accumulation; FSDP2 reads its switch in its post-backward too), it queues the parameter, and
the first one queues ``flush`` to run when the backward ends. ``flush`` reduces the queued
sums in buckets (parameters of one group, ZeRO stage and reduction dtype, packed rank-major as
the compiled graphs pack them, up to ``BUCKET_BYTES``), one ``zeroc::reduce_grad`` per bucket,
and hands each parameter its shard as ``move_grad`` would. Every rank queues the same
parameters (every rank runs the same graphs), and ``flush`` orders them by their index in the
model, so the ranks issue the same collectives in the same order.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from zeroc.runtime.zero_ops import WHOLE_FROM_SHARD, group_size, padded_numel_for

if TYPE_CHECKING:
    from zeroc.sharding.sharded_params import ShardedParam, ZeroState

__all__ = ["BUCKET_BYTES", "flush", "sink_accumulated"]

log = logging.getLogger(__name__)

BUCKET_BYTES = 25 * 2**20  # the default ``bucket_mb`` of the compiled graphs' reductions


def sink_accumulated(state: ZeroState, sharded: ShardedParam, sink: torch.Tensor) -> None:
    """The sink's post-accumulate hook: queue ``sharded`` when the switch is on again."""
    if sink is not sharded.sink or not state.requires_gradient_sync or sink.grad is None:
        return
    state.flushing.append(sharded)
    if len(state.flushing) == 1:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: flush(state))


def _width(sharded: ShardedParam, dp: int) -> int:
    """Elements of one rank's piece of the packed bucket (the whole gradient at stage 0)."""
    stage = sharded.spec.op_stage
    if stage == 0:
        return sharded.spec.numel
    if stage == 1:  # whole buffers reduce-scattered by rows
        return padded_numel_for(sharded.spec.shape, dp) // dp
    return sharded.flat.numel()  # this rank's rows, zero-padded


def _buckets(queued: list[ShardedParam]) -> list[list[ShardedParam]]:
    """``queued`` in buckets of one group, stage and reduction dtype, in model order."""
    buckets: list[list[ShardedParam]] = []
    open_: dict[tuple, tuple[list[ShardedParam], list[int]]] = {}
    for sharded in queued:
        grad = sharded.sink.grad
        key = (sharded.spec.group_name, sharded.spec.op_stage, grad.dtype, grad.device)
        size = grad.numel() * grad.element_size()
        members, used = open_.get(key, (None, [0]))
        if members is None or used[0] + size > BUCKET_BYTES:
            members, used = [], [0]
            open_[key] = (members, used)
            buckets.append(members)
        members.append(sharded)
        used[0] += size
    return buckets


def _reduce_bucket(bucket: list[ShardedParam]) -> list[torch.Tensor]:
    """Each member's reduced flat gradient (its ``flat``'s shape and dtype), by one
    ``zeroc::reduce_grad`` of the rank-major packed sums."""
    spec = bucket[0].spec
    stage, dp = spec.op_stage, group_size(spec.group_name)
    widths = [_width(s, dp) for s in bucket]
    grads = [s.sink.grad.reshape(-1) for s in bucket]
    if stage == 0:
        packed = torch.cat(grads)
    else:  # row r: every member's piece r, as the compiled reductions pack a bucket
        pieces = [F.pad(g, (0, dp * w - g.numel())).view(dp, w)
                  for g, w in zip(grads, widths, strict=True)]
        packed = torch.cat(pieces, dim=1).reshape(-1)
    reduced = torch.ops.zeroc.reduce_grad(packed, packed.numel(), spec.group_name,
                                          0 if stage == 0 else 2)
    out = []
    for sharded, part in zip(bucket, reduced.split(widths), strict=True):
        if stage == 1:  # this rank's rows in place in the whole buffer, zeros elsewhere
            part = WHOLE_FROM_SHARD(part, sharded.spec.numel, spec.group_name)
        out.append(part.to(sharded.flat.dtype))
    return out


def flush(state: ZeroState) -> None:
    """End of the backward that ends an accumulation: reduce every queued sum, bucketed, and
    give each parameter its gradient (which closes its sink)."""
    order = {id(s): i for i, s in enumerate(state.params)}
    queued = sorted(state.flushing, key=lambda s: order[id(s)])
    state.flushing = []
    buckets = _buckets(queued)
    for bucket in buckets:
        for sharded, grad in zip(bucket, _reduce_bucket(bucket), strict=True):
            sharded.flat.grad = grad
            sharded.move_grad(sharded.flat)
    log.debug("accumulation flushed: %d parameters in %d reductions", len(queued),
              len(buckets))
