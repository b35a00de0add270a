"""Collectives as compiled graphs use them, and the bytes each one moves.

Compiled graphs use torch's functional collectives (``torch.ops._c10d_functional``): an issue
op returns a tensor that is only valid after ``wait_tensor``, so a pass can place the issue
early (prefetch) and the wait late (overlap).

Bytes moved per rank follow the ZeRO paper's accounting: an all-gather or a reduce-scatter of
a buffer of Ψ bytes moves Ψ, an all-reduce moves 2Ψ.
"""

from __future__ import annotations

import torch

functional = torch.ops._c10d_functional

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
