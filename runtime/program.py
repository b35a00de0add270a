"""The frozen Program: what one compiled Dynamo graph runs, for pp = 1 and pp > 1 alike.

A ``Program`` is the compiler's output and the executors' input; nothing in it changes once
built (frozen dataclasses; a change is a new Program, ``dataclasses.replace``):

- ``graphs``: the functional FX graphs by name (``g0.forward``, ``g0.s1.input_grad``,
  ``g0.s0.fb1``), as the passes left them; ``str(program)`` prints them in that order.
- ``stages``: one ``StageProgram`` per stage this rank runs: the callables of its forward,
  backward, input-gradient (I) and weight-gradient (W) graphs, its inference graph, its F&B
  graphs (by the stage whose backward they overlap), and its inputs/messages layout.
- ``schedule``: pp > 1, the compute-only action ``Schedule`` every rank agrees on (its lowered
  form with p2p actions, for this rank's executor, is ``pipeline.schedule``); pp = 1, ``None``:
  one stage whose schedule is autograd's (AOTAutograd's runtime wrapper runs the forward and,
  on ``loss.backward()``, the backward, compiled on the first backward).
- ``pipeline``: pp > 1, the ``PipelineLayout`` the ranks share (messages, values, batch
  inputs, the lowered schedules); ``zero``: the model's ``ZeroLayout`` (``None`` if not
  parallelized); ``collectives``: the per-step collectives outside the graphs.
- ``summaries``: pp > 1, one ``StageSummary`` per stage of the whole pipeline (every rank's),
  for the plan; ``position_params``: pipeline position -> the parameters its ranks hold.
- ``record``: what the compiler recorded while building it (``ProgramRecord``: the graphs'
  costs, the kernels, the in-graph collectives, every pass's row, the Inductor source); the
  Plan is built from the Programs that run and what was measured
  (``zeroc.frontend.session_plan``), never from a record kept beside them.

A Program is also a pass subject (``pass_text``, ``pass_size``, ``pass_check``): the program
passes (``passes/program/split_weight_grad.py``, ``passes/program/overlap_fb.py``,
``passes/program/comm_lowering.py``) map a Program to a Program under ``run_passes``.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx

from zeroc.runtime.actions import Schedule
from zeroc.runtime.pipeline.zero import HoistedParam
from zeroc.runtime.plan.records import CollectiveInfo, GraphInfo, KernelInfo, ParamInfo, PassInfo

__all__ = ["PipelineLayout", "Program", "ProgramRecord", "StageProgram", "StageSummary",
           "ValueMeta", "frozen_mapping"]

def frozen_mapping(values: Mapping[Any, Any] | None = None) -> Mapping[Any, Any]:
    """A read-only copy of ``values`` (a Program's mappings cannot be changed in place)."""
    return types.MappingProxyType(dict(values or {}))


ValueMeta = tuple[tuple[int, ...], torch.dtype, bool]


@dataclasses.dataclass(frozen=True)
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
    # How micro-batch losses combine (see zeroc.passes.front.loss_normalization): the graphs
    # return numerators; the loss and every gradient are divided by the denominator, a
    # graph of the full-batch inputs (None: 1). "micro_mean" averages the micro-batches.
    loss_kind: str = "micro_mean"
    loss_denominator: Any = None
    # ZeRO once per step (runtime/pipeline/zero.py): this rank's parameters whose gather was
    # taken out of the stage graphs, and the bucket size of the per-step collectives.
    hoisted: dict[int, HoistedParam] = dataclasses.field(default_factory=dict)
    bucket_mb: float = 25.0
    prefetch: int = 1  # gather buckets in flight ahead of the one a stage waits for
    gather_quant: str | None = None  # "int8": the per-step gathers move int8 blocks + scales
    reduce_quant: str | None = None  # "int8" | "int4": the per-step reductions' rows quantized
    # The group of the pipeline's ranks for host-side checks (runtime/pipeline/inputs) and
    # the batch inputs' names for its errors.
    host_group_name: str = ""
    input_names: dict[int, str] = dataclasses.field(default_factory=dict)
    # The last stage's model outputs: the loss (unless an evaluation graph has none), then an
    # evaluation graph's per-sample outputs, (shape, dtype) at the call's sizes
    # (runtime/pipeline/outputs).
    has_loss: bool = True
    outputs: tuple[tuple[tuple[int, ...], Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class StageProgram:
    """A stage's graphs (what runs them) and the layout of their inputs and outputs.

    ``forward(params..., locals..., received...) -> (sent..., model outputs..., saved...)``;
    ``backward(saved..., tangents...) -> gradients in input order``; ``input_grad`` and
    ``weight_grad`` are that backward split in two (``None`` until ``split_weight_grad``
    runs): I returns ``num_input_grads`` gradients then the stash W reads, and W takes
    ``(stash..., backward inputs at w_inputs...)``. At pp = 1 only ``forward``, ``backward``
    and ``inference`` are set (AOTAutograd's wrapper calls them) and the layout is empty.
    """

    index: int
    forward: Callable[..., Any] | None
    backward: Callable[..., Any] | None
    param_inputs: tuple[int, ...] = ()
    local_inputs: tuple[int, ...] = ()
    in_keys: tuple[str, ...] = ()
    out_keys: tuple[str, ...] = ()
    num_model_outputs: int = 0
    tangent_outputs: tuple[int, ...] = ()
    input_grad: Callable[..., Any] | None = None
    weight_grad: Callable[..., Any] | None = None
    w_inputs: tuple[int, ...] = ()
    num_input_grads: int = 0
    # F&B graphs of this stage's forward with another stage's backward, by backward stage.
    overlapped: Mapping[int, Callable[..., Any]] = dataclasses.field(
        default_factory=frozen_mapping)
    # The forward-only graph for torch.no_grad() calls (no saved activations), compiled on
    # first use; None: run the training forward.
    inference: Callable[..., Any] | None = None


@dataclasses.dataclass(frozen=True)
class StageSummary:
    """What the plan shows of one pipeline stage (every stage, not only this rank's)."""

    index: int
    units: tuple[str, ...]
    flops: float
    bytes: float
    activation_bytes: int
    params: int  # elements of the whole (unsharded) parameters the stage reads
    param_bytes: int
    param_names: tuple[str, ...]
    message_bytes: int  # bytes this stage sends the next per micro-batch (0 for the last)


@dataclasses.dataclass(frozen=True)
class ProgramRecord:
    """What the compiler recorded while it built a Program (its rows of the Plan).

    ``graphs`` are the costed graphs (``joint``: the joint graph, before partition),
    ``kernels`` the kernels they launch, ``collectives`` those inside the graphs (pp > 1 adds
    the step's buckets), ``passes`` a row per pass run on them; ``saved_bytes`` and
    ``transient_bytes`` the activations the forward keeps and the largest working set;
    ``output_code`` Inductor's source by graph; ``collectives_moved`` the graphs whose
    collectives Inductor reordered.
    """

    params: tuple[ParamInfo, ...] = ()
    device: str = "cpu"
    zero: int = -1  # ZeRO stage of the graphs' parameters; -1: not parallelized
    zero_group: str = ""
    joint: GraphInfo | None = None
    graphs: tuple[GraphInfo, ...] = ()
    kernels: tuple[KernelInfo, ...] = ()
    collectives: tuple[CollectiveInfo, ...] = ()
    passes: tuple[PassInfo, ...] = ()
    saved_bytes: int = 0
    transient_bytes: int = 0
    output_code: Mapping[str, str] = dataclasses.field(default_factory=frozen_mapping)
    collectives_moved: tuple[str, ...] = ()


def _text(name: str, graph: torch.fx.GraphModule) -> str:
    body = graph.print_readable(print_output=False, include_stride=False,
                                include_device=False)
    return f"graph {name}:\n{body.rstrip()}\n"


def _work_nodes(graph: torch.fx.GraphModule) -> int:
    return sum(1 for n in graph.graph.nodes if n.op not in ("placeholder", "output"))


@dataclasses.dataclass(frozen=True)
class Program:
    """What one compiled Dynamo graph runs (see the module docstring)."""

    name: str
    graphs: Mapping[str, torch.fx.GraphModule]
    stages: tuple[StageProgram, ...]
    schedule: Schedule | None = None
    pipeline: PipelineLayout | None = None
    zero: Any = None  # the model's ZeroLayout, or None
    collectives: tuple[Any, ...] = ()
    summaries: tuple[StageSummary, ...] = ()
    position_params: Mapping[int, frozenset[str]] = dataclasses.field(
        default_factory=frozen_mapping)
    record: ProgramRecord = dataclasses.field(default_factory=ProgramRecord)

    def with_graph(self, name: str, graph: torch.fx.GraphModule,
                   stage: StageProgram | None = None) -> Program:
        """A new Program with ``graph`` under ``name`` (and ``stage`` replacing the stage of
        its index): pp = 1 adds its backward when autograd first calls it."""
        graphs = frozen_mapping({**self.graphs, name: graph})
        stages = self.stages if stage is None else tuple(
            stage if s.index == stage.index else s for s in self.stages)
        return dataclasses.replace(self, graphs=graphs, stages=stages)

    def graph_name(self, index: int, kind: str) -> str:
        """The name of stage ``index``'s graph of ``kind``: ``g0.s1.backward`` (pp > 1),
        ``g0.backward`` (pp = 1)."""
        return f"{self.name}.{kind}" if self.schedule is None else (
            f"{self.name}.s{index}.{kind}")

    def stage_map(self) -> dict[int, StageProgram]:
        """This rank's stages by index."""
        return {s.index: s for s in self.stages}

    def schedule_text(self) -> str:
        """This program's schedule: each rank's actions, lowered (with p2p) where they are."""
        if self.schedule is None:
            return "schedule: autograd's (forward now, backward on loss.backward())"
        shown = self.pipeline.schedule if self.pipeline is not None else self.schedule
        lines = [f"schedule {shown.name}: {shown.num_stages} stages on {shown.num_ranks} ranks, "
                 f"{shown.num_microbatches} micro-batches"]
        lines += [f"  r{r}: " + " ".join(str(a) for a in actions)
                  for r, actions in enumerate(shown.actions)]
        return "\n".join(lines)

    def __str__(self) -> str:
        held = ", ".join(f"s{s.index}" for s in self.stages)
        head = f"program {self.name}: stages {held or '-'}; {self.schedule_text()}\n"
        return head + "".join(_text(n, g) for n, g in self.graphs.items())

    def pass_text(self) -> str:
        """The readable text of the pass table's before/after: ``str(self)``."""
        return str(self)

    def pass_size(self) -> int:
        """The pass table's node count: the work nodes of every graph."""
        return sum(_work_nodes(g) for g in self.graphs.values())

    def pass_check(self) -> None:
        """Raise if the Program is inconsistent: a graph that does not lint, a stage twice, a
        stage with only half of its I/W split, F&B graphs of a stage it does not know, or a
        schedule that places a stage this program has no summary of."""
        for graph in self.graphs.values():
            graph.graph.lint()
        indices = [s.index for s in self.stages]
        if len(set(indices)) != len(indices):
            raise ValueError(f"program {self.name}: a stage appears twice in {indices}")
        for stage in self.stages:
            if (stage.input_grad is None) != (stage.weight_grad is None):
                raise ValueError(f"program {self.name}: stage {stage.index} has only one of "
                                 "its input-gradient and weight-gradient graphs")
        known = set(indices) | {s.index for s in self.summaries}
        for stage in self.stages:
            unknown = set(stage.overlapped) - known
            if unknown:
                raise ValueError(f"program {self.name}: stage {stage.index} overlaps the "
                                 f"backward of unknown stages {sorted(unknown)}")
        if self.schedule is not None and self.summaries and (
                self.schedule.num_stages != len(self.summaries)):
            raise ValueError(f"program {self.name}: the schedule has "
                             f"{self.schedule.num_stages} stages, the program "
                             f"{len(self.summaries)}")
