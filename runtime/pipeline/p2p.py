"""Point-to-point transfers of a pipeline step: batched isend/irecv and gradient exchange.

The executor issues each p2p group of the lowered schedule
(``zeroc.runtime.actions.p2p_groups``) as one ``batch_isend_irecv`` (``post_batch``) when it
reaches the group, and waits for a receive only right before the compute that reads its
value, for the rest at the end of the step. The groups are issued in the lowering's order,
which is deadlock-free for batched groups (``zeroc.passes.program.comm_lowering.verify_p2p``), and
every wait is at or after the point where that order would have waited, so NCCL's in-order
matching per pair of ranks cannot deadlock on it (``zeroc.runtime.nccl_order`` checks it on
what a step really issued). Messages carry several tensors; both sides enumerate them in the
same order. Works with gloo (CPU) and NCCL (GPU). A wait that blocks the host ends within
seconds when a peer's step failed (``zeroc.runtime.pipeline.abort.wait``).

``exchange_and_sum`` adds up the gradients of parameters that several pipeline ranks hold (a
tied embedding and head on the first and last stage, DualPipe's two copies of every stage):
every holder sends its gradient to the others and sums all of them in rank order, so every
holder ends with bitwise the same sum. ``owns_storage`` tells the executor whether a
micro-batch's first gradient may be kept and added to in place (a fresh tensor of its own
storage) or must be copied.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from zeroc.runtime import fake_replay, nccl_order
from zeroc.runtime.pipeline import abort as pipeline_abort


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One tensor to send to, or receive from, global rank ``peer``."""

    send: bool
    tensor: torch.Tensor
    peer: int


def post_batch(sends: list[tuple[list[torch.Tensor], int, str]],
               receives: list[tuple[list[torch.Tensor], int, str]],
               group: dist.ProcessGroup | None = None) -> tuple[list[Any], tuple[int, ...]]:
    """Issue ``sends`` and ``receives`` (each: tensors, the peer's global rank, a label for
    reports) as one ``batch_isend_irecv``, in that order; return its works, to wait for later
    (the caller keeps every tensor alive and unchanged until then), and the transfers'
    indices in ``nccl_order``'s record. Empty tensors are left out (both sides skip them)."""
    ops, noted = [], []
    for messages, send in ((sends, True), (receives, False)):
        function = dist.isend if send else dist.irecv
        for tensors, peer, label in messages:
            for tensor in tensors:
                if tensor.numel():
                    ops.append(dist.P2POp(function, tensor, peer, group))
                    noted.append((send, tensor, peer, label))
    if not ops:
        return [], ()
    indices = nccl_order.record([n[:3] for n in noted], batched=True,
                                labels=[n[3] for n in noted])
    return list(dist.batch_isend_irecv(ops)), indices


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
    indices = nccl_order.record([(t.send, t.tensor, t.peer) for t in transfers
                                 if t.tensor.numel()], batched=True, label="grad exchange")
    for work in dist.batch_isend_irecv(ops):
        pipeline_abort.wait(work, transfers[0].tensor.device, "a gradient exchange")
    nccl_order.waited(indices)


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


def storage_counts(values: tuple[Any, ...]) -> dict[int, int]:
    """How many of ``values`` (tensors; others are skipped) use each storage (also fakes)."""
    return dict(Counter(v.untyped_storage()._cdata for v in values
                        if isinstance(v, torch.Tensor) and v.numel()))


def owns_storage(grad: torch.Tensor, storages: dict[int, int]) -> bool:
    """Whether ``grad`` owns its storage: no view, exactly its size, shared by no other value."""
    storage = grad.untyped_storage()
    return (not fake_replay.is_view(grad) and storage.nbytes() == grad.numel() * grad.element_size()
            and storages.get(storage._cdata, 0) == 1)
