"""Point-to-point transfers of a pipeline step: batched isend/irecv and gradient exchange.

The executor posts the receives of a p2p group of the lowered schedule
(``zeroc.runtime.actions.p2p_groups``) before the compute that precedes the group, posts
the group's sends when it reaches it and waits for them only at the end of the step, and waits
for a receive only right before the compute that reads its value. Every wait is
at or after the point where the lowering's deadlock-free order (one batch per group, waited
at once) would have waited, so this order is deadlock-free too. Messages carry several
tensors; both sides enumerate them in the same order, so torch.distributed's in-order
matching of messages on a (source, destination) pair pairs them up. Works with gloo (CPU)
and NCCL (GPU).

``exchange_and_sum`` adds up the gradients of parameters that several pipeline ranks hold (a
tied embedding and head on the first and last stage, DualPipe's two copies of every stage):
every holder sends its gradient to the others and sums all of them in rank order, so every
holder ends with bitwise the same sum.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One tensor to send to, or receive from, global rank ``peer``."""

    send: bool
    tensor: torch.Tensor
    peer: int


def post_sends(tensors: list[torch.Tensor], peer: int,
               group: dist.ProcessGroup | None = None) -> list[Any]:
    """Post one ``isend`` per non-empty tensor to global rank ``peer``; return the works (the
    caller keeps each tensor alive and unchanged until its work is waited)."""
    return [dist.isend(t, peer, group) for t in tensors if t.numel()]


def post_receives(tensors: list[torch.Tensor], peer: int,
                  group: dist.ProcessGroup | None = None) -> list[Any]:
    """Post one ``irecv`` per non-empty tensor from global rank ``peer``; return the works."""
    return [dist.irecv(t, peer, group) for t in tensors if t.numel()]


def run_transfers(transfers: list[Transfer], group: dist.ProcessGroup | None = None) -> None:
    """Post ``transfers`` as one batch and wait until all of them completed."""
    ops = []
    for transfer in transfers:
        if transfer.tensor.numel() == 0:
            continue
        function = dist.isend if transfer.send else dist.irecv
        ops.append(dist.P2POp(function, transfer.tensor, transfer.peer, group))
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def exchange_and_sum(
    grads: dict[int, torch.Tensor],
    holders: dict[int, tuple[int, ...]],
    my_position: int,
    global_ranks: tuple[int, ...],
) -> dict[int, torch.Tensor]:
    """Sum each gradient over the pipeline positions in ``holders[index]``.

    ``grads`` maps a parameter index to this rank's gradient; ``holders`` maps it to the
    pipeline positions holding it (this rank's position among them); ``global_ranks[p]`` is the
    global rank of position ``p``. Parameters with a single holder are returned unchanged.
    """
    shared = sorted(i for i in grads if len(holders.get(i, ())) > 1)
    if not shared:
        return dict(grads)
    received: dict[tuple[int, int], torch.Tensor] = {}
    transfers = []
    for index in shared:
        mine = grads[index].contiguous()
        grads[index] = mine
        for position in holders[index]:
            if position == my_position:
                continue
            buffer = torch.empty_like(mine)
            received[(index, position)] = buffer
            transfers.append(Transfer(True, mine, global_ranks[position]))
            transfers.append(Transfer(False, buffer, global_ranks[position]))
    run_transfers(transfers)
    summed = dict(grads)
    for index in shared:
        parts = [grads[index] if p == my_position else received[(index, p)]
                 for p in sorted(holders[index])]
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        summed[index] = total
    return summed
