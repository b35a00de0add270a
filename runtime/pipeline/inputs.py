"""The batch every rank of a pipeline passes, compared before the step's first transfer.

Every rank of one pipeline must run the same batch: the stages exchange its activations, so
ranks given batches of different shapes or dtypes would send and receive buffers of
different sizes, which gloo aborts the process on and NCCL hangs or corrupts. Before the
step issues anything, each rank all-gathers a small signature of its batch inputs (dtype,
number of dimensions, sizes) over its pipeline's host group (``Mesh.pp_host_group``: CPU
tensors, the pipeline group itself on gloo, a gloo group beside NCCL), so the comparison is
read on the host without waiting for the device; a difference raises the same
``ValueError`` on every rank, naming the ranks and the input.

Values are compared later, by the step's closing all-gather (``runtime/pipeline/sync``): a
digest of each input's bit patterns, so that equal batches holding NaN compare equal.

The same row carries the step's number (the model's ``StepCounter``) and whether it trains:
ranks at different steps, or one training while another runs ``no_grad``, raise
``StepMismatchError`` on every rank, naming both (``runtime/pipeline/abort``). The all-gather
is waited through ``pipeline_abort.wait``: a peer whose step failed ends it within seconds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zeroc.runtime.mesh import resolve_group
from zeroc.runtime.pipeline import abort as pipeline_abort
from zeroc.runtime.pipeline.abort import StepMismatchError
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
                      global_ranks: Sequence[int], step: int = 0, train: bool = True) -> None:
    """All-gather the step's number, its kind and the batch's signature over the host group
    ``group_name``; raise on every rank of the pipeline if two ranks differ (see the module
    docstring)."""
    group = resolve_group(group_name)
    if group is None:
        return
    mine = torch.tensor([step, int(train), *signature(inputs, batch_inputs)],
                        dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(group.size())]
    pipeline_abort.wait(dist.all_gather(rows, mine, group=group, async_op=True),
                        mine.device, "the step's signature")
    if isinstance(rows[0], FakeTensor):
        return  # a planned world: one program stands for every rank, there is no value
    values = [r.tolist() for r in rows]
    _check_steps([v[:2] for v in values], global_ranks)
    values = [v[2:] for v in values]
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


def _check_steps(heads: list[list[int]], global_ranks: Sequence[int]) -> None:
    """Raise ``StepMismatchError`` where the ranks' (step, trains) heads differ."""
    odd = next((r for r in range(1, len(heads)) if heads[r] != heads[0]), None)
    if odd is None:
        return
    kinds = {1: "a training step", 0: "a forward-only (no_grad) step"}
    (step, train), (other, other_train) = heads[0], heads[odd]
    raise StepMismatchError(
        f"zeroc pipeline: the ranks of one pipeline are not at the same step of this model: "
        f"rank {global_ranks[0]} runs step {step} ({kinds[train]}) and rank "
        f"{global_ranks[odd]} step {other} ({kinds[other_train]}). Every rank must make the "
        "same calls of the compiled model, in the same order: a rank whose call raised "
        "must not skip or repeat a step its peers run. Nothing of this step has moved or "
        "been applied")
