"""Collectives as compiled graphs use them, and the bytes each one moves.

Compiled graphs use torch's functional collectives (``torch.ops._c10d_functional``): an issue
op returns a tensor that is only valid after ``wait_tensor``, so a pass can place the issue
early (prefetch) and the wait late (overlap). This module adds ``zeroc::local_rows``, which
selects this rank's row of a ``[ranks, n]`` buffer at run time, so that a graph never bakes a
rank number in and every rank of a group compiles the same graph.

Bytes moved per rank follow the ZeRO paper's accounting: an all-gather or a reduce-scatter of
a buffer of Ψ bytes moves Ψ, an all-reduce moves 2Ψ.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zeroc.runtime.mesh import resolve_group

functional = torch.ops._c10d_functional

_LIB = torch.library.Library("zeroc", "FRAGMENT")
_LIB.define("local_rows(Tensor buffer, int rows, str group_name) -> Tensor")


@torch.library.impl(_LIB, "local_rows", "CompositeExplicitAutograd")
def _local_rows(buffer: torch.Tensor, rows: int, group_name: str) -> torch.Tensor:
    group = resolve_group(group_name)
    index = 0 if group is None else dist.get_rank(group)
    return buffer.reshape(rows, -1)[index].clone()


@torch.library.register_fake("zeroc::local_rows", lib=_LIB)
def _local_rows_fake(buffer: torch.Tensor, rows: int, group_name: str) -> torch.Tensor:
    return buffer.new_empty(buffer.numel() // rows)


ISSUE_OPS = {
    functional.all_gather_into_tensor.default: "all_gather",
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
