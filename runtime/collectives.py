"""Collectives as compiled graphs use them, and the bytes each one moves.

Compiled graphs use torch's functional collectives (``torch.ops._c10d_functional``): an issue
op returns a tensor that is only valid after ``wait_tensor``, so a pass can place the issue
early (prefetch) and the wait late (overlap).

Bytes moved per rank follow the ZeRO paper's accounting: an all-gather or a reduce-scatter of
a buffer of Ψ bytes moves Ψ, an all-reduce moves 2Ψ.

Gloo has no reduce-scatter of its own: ``reduce_scatter_tensor`` clones its input, all-reduces
the clone and, when waited, copies this rank's chunk into a new tensor, which the graph then
divides by the group size. ``all_reduce`` followed by ``zeroc::rank_chunk_mean`` (the chunk,
divided) computes the same values with one copy less (``reduce_scatter_runs_as_all_reduce``
says when a group does this). Such a reduction is recorded as the reduce-scatter it stands for.

Both move twice the bytes of a ring reduce-scatter (at 1 Gbit/s on 2 ranks, 16 MiB: 276 ms,
as an all-reduce). A pipeline's per-step reductions (``zeroc.runtime.pipeline_zero``) use
``all_to_all_single`` on gloo instead (``reduces_by_all_to_all``): the buffer is rank-major
(row r is every parameter's chunk r), row r goes to rank r, and each rank sums the rows it
received and divides (``chunk_sum_mean``): (W - 1) / W of the buffer per rank, what NCCL's
reduce-scatter moves (114 ms for the 16 MiB above). The compiled graphs keep the all-reduce:
the planned world's memory model frees a collective's input after its issue, which an
all-to-all's work holds until its wait.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zeroc.runtime.mesh import resolve_group

functional = torch.ops._c10d_functional

ISSUE_OPS = {
    functional.all_gather_into_tensor.default: "all_gather",
    functional.all_gather_into_tensor_coalesced.default: "all_gather",
    functional.reduce_scatter_tensor.default: "reduce_scatter",
    functional.all_reduce.default: "all_reduce",
}
WAIT_OP = functional.wait_tensor.default


def collective_bytes(op: str, in_bytes: int, out_bytes: int) -> int:
    """Bytes one rank moves for a collective (ZeRO accounting; see the module docstring)."""
    if op == "all_gather":
        return out_bytes
    if op == "reduce_scatter":
        return in_bytes
    if op == "all_reduce":
        return 2 * in_bytes
    raise ValueError(f"unknown collective {op!r}; known: all_gather, reduce_scatter, all_reduce")


def reduce_scatter_runs_as_all_reduce(group_name: str, device: torch.device,
                                      planned: bool = False) -> bool:
    """Whether the group reduce-scatters tensors of ``device`` by an all-reduce (gloo).

    ``planned``: the graph is compiled for a planned world (its group is a fake one), where a
    CPU job is planned as it runs: on gloo."""
    group = resolve_group(group_name)
    if group is None:
        return False
    if planned:
        return torch.device(device).type == "cpu"
    return reduces_by_all_to_all(group, device)


def reduces_by_all_to_all(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group`` runs tensors of ``device`` on gloo, where a pipeline's per-step
    reductions use an all-to-all (module docstring)."""
    try:
        backend = group._get_backend(torch.device(device))
    except (RuntimeError, ValueError):
        return False
    gloo = getattr(dist, "ProcessGroupGloo", None)
    return gloo is not None and isinstance(backend, gloo)


def chunk_sum_mean(received: torch.Tensor, group_size: int) -> torch.Tensor:
    """This rank's reduced chunk from what an all-to-all of rank-major rows delivered: the
    ``group_size`` rows summed (in rank order) and divided by ``group_size``. A fresh tensor."""
    return received.view(group_size, -1).sum(0).div_(group_size)


_LIB = torch.library.Library("zeroc", "FRAGMENT")
_LIB.define("rank_chunk_mean(Tensor summed, int group_size, str group_name) -> Tensor")


@torch.library.impl(_LIB, "rank_chunk_mean", "CompositeExplicitAutograd")
def _rank_chunk_mean(summed: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """This rank's chunk of the all-reduced 1-D ``summed`` (``group_size`` equal chunks,
    rank-major), divided by ``group_size``: what ``reduce_scatter_tensor`` followed by the
    division returns. A fresh tensor."""
    rank = dist.get_rank(resolve_group(group_name))
    return summed.view(group_size, -1)[rank].div(group_size)


@torch.library.register_fake("zeroc::rank_chunk_mean", lib=_LIB)
def _rank_chunk_mean_fake(summed: torch.Tensor, group_size: int,
                          group_name: str) -> torch.Tensor:
    return summed.new_empty(summed.shape[0] // group_size)


RANK_CHUNK_MEAN = torch.ops.zeroc.rank_chunk_mean.default
