"""Collectives as compiled graphs use them, and the bytes each one moves.

Compiled graphs use torch's functional collectives (``torch.ops._c10d_functional``): an issue
op returns a tensor that is only valid after ``wait_tensor``, so a pass can place the issue
early (prefetch) and the wait late (overlap).

Bytes moved per rank follow the ZeRO paper's accounting: an all-gather or a reduce-scatter of
a buffer of Ψ bytes moves Ψ, an all-reduce moves 2Ψ.

Gloo's ``reduce_scatter_tensor`` is an all-reduce of a clone followed by a copy of this
rank's chunk: twice the bytes of a ring reduce-scatter (at 1 Gbit/s on 2 ranks, 16 MiB:
276 ms, as an all-reduce). On gloo zeroc reduce-scatters with ``all_to_all_single`` instead,
in the compiled graphs and in a pipeline's per-step reductions
(``reduce_scatter_runs_as_all_to_all``, ``reduces_by_all_to_all``): the buffer is rank-major
(row r is every parameter's chunk r), row r goes to rank r, and each rank sums the rows it
received in rank order and divides (``zeroc::rows_sum_mean``): (W - 1) / W of the buffer per
rank, what NCCL's reduce-scatter moves (114 ms for the 16 MiB above). ``rows_sum_mean`` also
takes the buffer that was sent, so that a graph keeps it alive until the rows are summed, as
the collective's work does (a planned world's memory then matches a real run's). Such a
reduction is recorded as the reduce-scatter it stands for.
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
    # On gloo zeroc's reduce-scatter (module docstring).
    functional.all_to_all_single.default: "reduce_scatter",
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


def reduce_scatter_runs_as_all_to_all(group_name: str, device: torch.device,
                                      planned: bool = False) -> bool:
    """Whether the group reduce-scatters tensors of ``device`` by an all-to-all (gloo).

    ``planned``: the graph is compiled for a planned world (its group is a fake one), where a
    CPU job is planned as it runs: on gloo."""
    group = resolve_group(group_name)
    if group is None:
        return False
    if planned:
        return torch.device(device).type == "cpu"
    return reduces_by_all_to_all(group, device)


def reduces_by_all_to_all(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group`` runs tensors of ``device`` on gloo, whose reduce-scatter zeroc
    runs as an all-to-all (module docstring)."""
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
_LIB.define("rows_sum_mean(Tensor received, Tensor sent, int group_size) -> Tensor")


@torch.library.impl(_LIB, "rows_sum_mean", "CompositeExplicitAutograd")
def _rows_sum_mean(received: torch.Tensor, sent: torch.Tensor, group_size: int) -> torch.Tensor:
    """``chunk_sum_mean(received, group_size)``; ``sent`` (the all-to-all's input) is only
    held until here (module docstring)."""
    del sent
    return chunk_sum_mean(received, group_size)


@torch.library.register_fake("zeroc::rows_sum_mean", lib=_LIB)
def _rows_sum_mean_fake(received: torch.Tensor, sent: torch.Tensor,
                        group_size: int) -> torch.Tensor:
    return received.new_empty(received.shape[0] // group_size)


ROWS_SUM_MEAN = torch.ops.zeroc.rows_sum_mean.default
