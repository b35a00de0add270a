"""What a pipeline's per-step ZeRO works on, and in what order: ``HoistedParam`` (a parameter
whose gather was taken out of the stage graphs), its buckets, and ``ZeroOrder`` (when this
rank's gathers and reductions are issued, from its schedule), for
``zeroc.runtime.pipeline.zero.StepZero``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from zeroc.runtime.zero_ops import WHOLE_STAGES, group_size, padded_numel_for

__all__ = ["HoistedParam", "ZeroOrder", "buckets", "zero_order"]


@dataclasses.dataclass(frozen=True)
class HoistedParam:
    """A parameter whose ``zeroc::unshard`` was taken out of the stage graphs.

    ``shape``/``numel``: the full parameter; ``zero_stage``: the op stage (0: whole
    parameter, gradients all-reduced; 1: whole parameter, gradients reduce-scattered into
    this rank's rows; 2, 3: sharded)."""

    index: int
    name: str
    shape: tuple[int, ...]
    numel: int
    group_name: str
    zero_stage: int
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None

    def ranks(self) -> int:
        """How many shards the flat buffer is cut into (1: whole)."""
        if self.zero_stage in WHOLE_STAGES or not self.group_name:
            return 1
        return group_size(self.group_name)

    def reduced_by(self) -> int:
        """How many ranks' rows the gradient is reduce-scattered into (1: all-reduced)."""
        return 1 if self.zero_stage == 0 or not self.group_name else group_size(
            self.group_name)

    def padded_numel(self) -> int:
        """The gradient's size padded to ``reduced_by`` equal pieces of whole rows."""
        return padded_numel_for(self.shape, self.reduced_by()) if self.shape else self.numel

    def bucket_key(self, dtype: torch.dtype) -> tuple[str, int, torch.dtype]:
        return (self.group_name, self.zero_stage, dtype)


def buckets(params: list[tuple[HoistedParam, torch.Tensor]], cap_bytes: float,
             dtype_of) -> list[list[tuple[HoistedParam, torch.Tensor]]]:
    """Consecutive runs of one (group, stage, dtype) of at most ``cap_bytes`` each."""
    buckets: list[list[tuple[HoistedParam, torch.Tensor]]] = []
    key, size = None, 0.0
    for param, tensor in params:
        dtype = dtype_of(param, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or param.bucket_key(dtype) != key or size + nbytes > cap_bytes:
            buckets.append([])
            key, size = param.bucket_key(dtype), 0.0
        buckets[-1].append((param, tensor))
        size += nbytes
    return buckets


@dataclasses.dataclass(frozen=True)
class ZeroOrder:
    """When this rank's per-step collectives are issued, from its schedule.

    ``gathers``: per stage in the order of its first forward, the hoisted parameters it
    gathers (a parameter two stages read is gathered by the first); ``reduces``: action group
    position -> (stage, the parameters whose gradients are complete after that group)."""

    gathers: tuple[tuple[int, tuple[int, ...]], ...]
    reduces: Mapping[int, tuple[int, tuple[int, ...]]]

    def reduce_stage(self) -> dict[int, int]:
        """Parameter -> the stage whose buckets reduce it."""
        return {i: stage for stage, indices in self.reduces.values() for i in indices}


def zero_order(groups: tuple[tuple[Any, ...], ...], stage_params: Mapping[int, tuple[int, ...]],
               hoisted: Mapping[int, HoistedParam]) -> ZeroOrder:
    """The ``ZeroOrder`` of one rank's action ``groups`` (``runtime/actions.p2p_groups``):
    stages gather in the order of their first forward; a parameter's gradient is complete
    after the last group that runs a B or W (an FB's backward part included) of any stage of
    this rank reading it."""
    first_forward: list[int] = []
    last_backward: dict[int, int] = {}
    for position, group in enumerate(groups):
        for action in group:
            for part in action.parts():
                kind = part.kind.value
                if kind == "F" and part.stage not in first_forward:
                    first_forward.append(part.stage)
                elif kind in ("B", "W"):
                    last_backward[part.stage] = position
    gathers, taken = [], set()
    for stage in first_forward:
        mine = tuple(i for i in stage_params.get(stage, ()) if i in hoisted and i not in taken)
        taken.update(mine)
        gathers.append((stage, mine))
    complete: dict[int, tuple[int, int]] = {}  # parameter -> (position, stage)
    for stage, position in last_backward.items():
        for index in stage_params.get(stage, ()):
            if index in hoisted:
                complete[index] = max(complete.get(index, (-1, -1)), (position, stage))
    reduces: dict[int, tuple[int, list[int]]] = {}
    for index, (position, stage) in sorted(complete.items()):
        reduces.setdefault(position, (stage, []))[1].append(index)
    return ZeroOrder(tuple(gathers), {p: (s, tuple(i)) for p, (s, i) in sorted(reduces.items())})
