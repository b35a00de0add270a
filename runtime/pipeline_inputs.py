"""The batch every rank of a pipeline passes, compared before the step's first transfer.

Every rank of one pipeline must run the same batch: the stages exchange its activations, so
ranks given batches of different shapes or dtypes would send and receive buffers of
different sizes, which gloo aborts the process on and NCCL hangs or corrupts. Before the
step issues anything, each rank all-gathers a small signature of its batch inputs (dtype,
number of dimensions, sizes) over its pipeline's host group (``Mesh.pp_host_group``: CPU
tensors, the pipeline group itself on gloo, a gloo group beside NCCL), so the comparison is
read on the host without waiting for the device; a difference raises the same
``ValueError`` on every rank, naming the ranks and the input.

Values are compared later, by the step's closing all-gather (``runtime/pipeline_sync``): a
digest of each input's bit patterns, so that equal batches holding NaN compare equal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zeroc.runtime.mesh import resolve_group
from zeroc.runtime.torch_compat import FakeTensor

__all__ = ["check_same_shapes", "signature"]

MAX_DIMS = 8  # sizes beyond these are folded into the last one (a signature, not a shape)
_DTYPES = {dtype: code for code, dtype in enumerate(
    sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))}


def signature(inputs: Sequence[Any], batch_inputs: Sequence[int]) -> list[int]:
    """Per batch input: its dtype's code, its number of dimensions and its sizes."""
    row: list[int] = []
    for index in batch_inputs:
        value = inputs[index]
        shape = list(value.shape)
        if len(shape) > MAX_DIMS:
            folded = 1
            for size in shape[MAX_DIMS - 1:]:
                folded *= size
            shape = shape[:MAX_DIMS - 1] + [folded]
        row += [_DTYPES.get(value.dtype, -1), value.dim(), *shape,
                *([-1] * (MAX_DIMS - len(shape)))]
    return row


def _describe(row: Sequence[int], k: int) -> str:
    """``int64 [8, 16]`` for input ``k`` of a signature row."""
    width = 2 + MAX_DIMS
    code, ndim, *sizes = row[k * width:(k + 1) * width]
    name = next((str(d).removeprefix("torch.") for d, c in _DTYPES.items() if c == code), "?")
    return f"{name} {list(sizes[:min(ndim, MAX_DIMS)])}"


def check_same_shapes(inputs: Sequence[Any], batch_inputs: Sequence[int],
                      names: Mapping[int, str], group_name: str,
                      global_ranks: Sequence[int]) -> None:
    """All-gather the batch's signature over the host group ``group_name``; raise on every
    rank of the pipeline if two ranks differ (see the module docstring)."""
    group = resolve_group(group_name)
    if group is None:
        return
    mine = torch.tensor(signature(inputs, batch_inputs), dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(rows, mine, group=group)
    if isinstance(rows[0], FakeTensor):
        return  # a planned world: one program stands for every rank, there is no value
    values = [r.tolist() for r in rows]
    odd = next((r for r in range(1, len(values)) if values[r] != values[0]), None)
    if odd is None:
        return
    width = 2 + MAX_DIMS
    k = next(k for k in range(len(batch_inputs))
             if values[odd][k * width:(k + 1) * width] != values[0][k * width:(k + 1) * width])
    index = batch_inputs[k]
    name = names.get(index, f"input {index}")
    raise ValueError(
        f"zeroc pipeline: the ranks of one pipeline were given batches of different shapes or "
        f"dtypes: {name} is {_describe(values[0], k)} on rank {global_ranks[0]} and "
        f"{_describe(values[odd], k)} on rank {global_ranks[odd]}. Every rank of a pipeline "
        "must pass the same batch (checked before the step moves anything). Shard the data "
        "over the data-parallel dimension only, e.g. DistributedSampler(dataset, "
        "num_replicas=zeroc.data_parallel_size(model), rank=zeroc.data_parallel_rank(model))")
