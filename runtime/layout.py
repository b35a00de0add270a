"""The parallel layout of a parallelized model: ``ZeroLayout``, its ``ParamShard`` records and
``MixedPrecision``.

``zeroc.parallelize`` builds one frozen ``ZeroLayout`` per model: the mesh (pp x dp and the
groups), the ZeRO stage, mixed precision, the options that change what a rank holds or moves
(offload, quantized collectives, hpZ), every parameter's shard record, and ``planned`` (the
planned world it was made in, if any). The compile path reads the layout from the model's
parameters and hands it to what acts on it; the sharding arithmetic it uses is
``zeroc.runtime.zero_ops``'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container
from typing import Any

import torch

from zeroc.runtime.mesh import Mesh
from zeroc.runtime.world import PlannedWorld
from zeroc.runtime.zero_ops import local_rows_for, row_numel, rows_per_shard

__all__ = ["MixedPrecision", "ParamShard", "ZeroLayout", "mixed_precision_policy"]


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of a ZeRO model's compute and communication, as FSDP2's ``MixedPrecisionPolicy``.

    ``param_dtype``: parameters are cast to it before they are gathered (so the gather moves
    that dtype) and the forward and backward compute in it; the float32 shards stay the
    optimizer's master copy. ``reduce_dtype``: gradients are cast to it before they are
    reduced (default: ``param_dtype``). ``output_dtype``: floating-point outputs of the model's
    forward are cast to it. ``cast_forward_inputs``: floating-point inputs of the model's
    forward are cast to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise ValueError(
                    f"MixedPrecision({field}={value!r}) is not allowed: use None or a "
                    "floating-point torch.dtype (torch.bfloat16, torch.float16, torch.float32)"
                )

    @property
    def gradient_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduced in (``None``: the parameters' own)."""
        return self.reduce_dtype or self.param_dtype

    def describe(self) -> str:
        """``param=bfloat16 reduce=float32`` (the dtypes that differ from float32)."""
        parts = [f"{k}={str(getattr(self, k + '_dtype')).removeprefix('torch.')}"
                 for k in ("param", "reduce", "output") if getattr(self, k + "_dtype")]
        return " ".join(parts) or "none"


@dataclasses.dataclass(frozen=True)
class ParamShard:
    """How one model parameter is held on this rank.

    ``name`` is its state-dict and ``named_parameters`` name (first owner), ``tied_names``
    the other names of the same tensor (e.g. a tied embedding and head). ``param_name`` is the
    same name (kept for readers of older plans). The parameter the user sees is an
    ``nn.Parameter`` holding a DTensor of the original ``shape`` (``Shard(0)`` when
    ``sharded``, else ``Replicate()``; a plain tensor without a process group); the graphs
    read its flat buffer of ``shard_numel`` elements, which the ops take with stage
    ``op_stage``. ``local_rows`` rows of dimension 0 are this rank's (all of them when not
    sharded).
    """

    name: str
    param_name: str
    tied_names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    numel: int
    padded_numel: int
    shard_numel: int
    requires_grad: bool
    sharded: bool = True
    op_stage: int = 3
    local_rows: int = 0

    @property
    def names(self) -> tuple[str, ...]:
        """Every state-dict name of this parameter: ``name`` first, then ``tied_names``."""
        return (self.name, *self.tied_names)


@dataclasses.dataclass(frozen=True)
class ZeroLayout:
    """What ``zeroc.parallelize`` did to a model: the mesh, the stage and every parameter."""

    zero: int
    pp: int
    dp: int
    world: int
    mixed_precision: MixedPrecision | None
    mesh: Mesh
    params: tuple[ParamShard, ...]
    # parallelize(layout="auto"): the compile options zeroc.tune chose with this layout (the
    # compile's defaults when the inputs have the shapes it was tuned for, ``tuned_inputs``;
    # options the user passes win) and the tune cache file it came from.
    tuned_options: tuple[tuple[str, Any], ...] = ()
    tuned_from: str = ""
    tuned_inputs: tuple[tuple[int, ...], ...] = ()
    # The world zeroc.world plans this layout for (fake tensors); None: a real run.
    planned: PlannedWorld | None = None
    # "optimizer": gradients and optimizer state of each rank's rows live on the host
    # (``zeroc.sharding.offload``); the device holds the flat buffers only.
    offload: str | None = None

    @property
    def dp_group_name(self) -> str:
        """The data-parallel group the parameters are sharded over (``""`` when dp is 1)."""
        return self.mesh.dp_group_name

    def by_name(self) -> dict[str, ParamShard]:
        """Every state-dict name of every parameter (tied aliases included) -> its record."""
        return {name: record for record in self.params for name in record.names}

    def held_bytes(self, optimizer_states: int = 2, names: Container[str] | None = None,
                   dp_index: int | None = None) -> tuple[int, int, int]:
        """Bytes a rank holds between steps: (parameters, gradients, optimizer state).

        Parameters: the flat buffers (stages 0 and 1: whole; 2 and 3: this rank's padded rows).
        With optimizer offload the gradients and optimizer state are on the host: 0 here.
        Gradients (after the backward, until ``zero_grad``): whole at stage 0, this rank's
        rows at 1, 2 and 3. Optimizer state: ``optimizer_states`` tensors (Adam: 2) of
        this rank's rows (stage 0: whole). Frozen parameters have neither. ``names``: only
        the parameters of these names (a pipeline rank's own stages); ``dp_index``: the rows
        of that data-parallel index instead of this rank's.
        """
        params = grads = optimizer = 0
        for record in self.params:
            if names is not None and record.param_name not in names:
                continue
            itemsize = getattr(torch, record.dtype).itemsize
            params += record.shard_numel * itemsize
            if not record.requires_grad:
                continue
            whole = record.numel
            rows = record.local_rows if dp_index is None or not record.sharded else (
                local_rows_for(record.shape, self.dp, dp_index))
            local = rows * (record.numel // record.shape[0]) if (
                record.sharded and record.shape and record.shape[0]) else whole
            grads += (whole if record.op_stage == 0 else local) * itemsize
            optimizer += optimizer_states * local * itemsize
        if self.offload is not None:  # on the host (``host_bytes``), not on the device
            return params, 0, 0
        return params, grads, optimizer

    def host_bytes(self, optimizer_states: int = 2, dp_index: int | None = None) -> int:
        """Optimizer offload: bytes a rank holds on the host between steps, its master rows,
        their gradients and ``optimizer_states`` tensors of them (0 without offload)."""
        if self.offload is None:
            return 0
        rows = dataclasses.replace(self, offload=None).held_bytes(
            optimizer_states, dp_index=dp_index)
        masters = sum(
            (local_rows_for(r.shape, self.dp, dp_index) if dp_index is not None else
             r.local_rows) * (r.numel // r.shape[0]) * getattr(torch, r.dtype).itemsize
            for r in self.params if r.sharded and r.shape and r.shape[0])
        return masters + rows[1] + rows[2]

    def step_gather_bytes(self) -> int:
        """ZeRO-1: bytes of the one all-gather after ``optimizer.step()`` (0 otherwise)."""
        if self.zero != 1 or self.dp == 1:
            return 0
        return sum(self.dp * rows_per_shard(r.shape, self.dp) * row_numel(r.shape)
                   * getattr(torch, r.dtype).itemsize
                   for r in self.params if r.sharded and r.requires_grad)


def mixed_precision_policy(mixed_precision: Any) -> MixedPrecision | None:
    """``parallelize``'s ``mixed_precision`` option as a ``MixedPrecision`` (or None)."""
    if mixed_precision is None or isinstance(mixed_precision, MixedPrecision):
        return mixed_precision
    if mixed_precision == "bf16":
        return MixedPrecision(param_dtype=torch.bfloat16)
    raise ValueError(
        f"mixed_precision={mixed_precision!r} is not allowed: use None, 'bf16' or "
        "zeroc.MixedPrecision(param_dtype=..., reduce_dtype=..., output_dtype=...)"
    )
