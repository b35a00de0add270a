"""What a compiled pipeline is made of: each stage's graphs and the layout every rank shares.

A ``StageProgram`` holds a stage's compiled functional graphs (DESIGN.md §4.1):
``forward(params..., locals..., received...) -> (sent..., model outputs..., saved...)``,
``backward(saved..., tangents...) -> gradients in input order``, and the same backward split
into ``input_grad`` (I) and ``weight_grad`` (W). A ``PipelineLayout`` is what every rank of
the pipeline agrees on; ``zeroc.runtime.pipeline_executor`` runs one rank's part of a step
from the two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from zeroc.runtime.actions import Schedule
from zeroc.runtime.pipeline_zero import HoistedParam

__all__ = ["PipelineLayout", "StageProgram", "ValueMeta"]

ValueMeta = tuple[tuple[int, ...], torch.dtype, bool]


@dataclasses.dataclass
class StageProgram:
    """A stage's compiled graphs and the layout of their inputs and outputs."""

    index: int
    forward: Callable[..., Any]
    backward: Callable[..., Any]
    input_grad: Callable[..., Any]
    weight_grad: Callable[..., Any]
    w_inputs: tuple[int, ...]
    num_input_grads: int
    param_inputs: tuple[int, ...]
    local_inputs: tuple[int, ...]
    in_keys: tuple[str, ...]
    out_keys: tuple[str, ...]
    num_model_outputs: int
    tangent_outputs: tuple[int, ...]
    # F&B graphs of this stage's forward with another stage's backward, by backward stage.
    overlapped: dict[int, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    # The forward-only graph for torch.no_grad() calls (no saved activations), compiled on
    # first use; None: run the training forward.
    inference: Callable[..., Any] | None = None


@dataclasses.dataclass
class PipelineLayout:
    """What every rank of the pipeline agrees on (computed identically everywhere)."""

    schedule: Schedule
    forward_schedule: Schedule
    messages: tuple[tuple[str, ...], ...]
    values: dict[str, ValueMeta]
    batch_inputs: frozenset[int]
    microbatch: int
    holders: dict[int, tuple[int, ...]]
    position: int
    global_ranks: tuple[int, ...]
    group_name: str
    # How micro-batch losses combine (see zeroc.passes.loss_normalization): the graphs
    # return numerators; the loss and every gradient are divided by the denominator, a
    # graph of the full-batch inputs (None: 1). "micro_mean" averages the micro-batches.
    loss_kind: str = "micro_mean"
    loss_denominator: Any = None
    # ZeRO once per step (runtime/pipeline_zero.py): this rank's parameters whose gather was
    # taken out of the stage graphs, and the bucket size of the per-step collectives.
    hoisted: dict[int, HoistedParam] = dataclasses.field(default_factory=dict)
    bucket_mb: float = 25.0
    # The group of the pipeline's ranks for host-side checks (runtime/pipeline_inputs) and
    # the batch inputs' names for its errors.
    host_group_name: str = ""
    input_names: dict[int, str] = dataclasses.field(default_factory=dict)
