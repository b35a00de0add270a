"""The frozen pp > 1 ``Program`` of one compiled Dynamo graph, and its program passes.

``pipeline_program`` assembles the ``zeroc.runtime.program.Program`` from the pipeline front
(the split, the schedule) and this rank's compiled stages (``zeroc.pipeline.pipeline_capture``
compiles each through ``zeroc.frontend.stage_compiler``). ``run_program_passes`` then runs
``PROGRAM_PASSES`` over it under ``run_passes`` (each a Program -> Program pass with its row in
the plan's pass table, graph name ``<prefix>.program``):

1. ``split_weight_grad``: every stage's backward -> its I and W graphs;
2. ``overlap_fb``: the F&B graph of every overlapped action this rank runs;
3. ``comm_lowering``: the schedules the executor runs, with their p2p actions.

The plan's graph records gain the I/W graphs the first pass made, in the program's order.

Kernels (``program_with_inductor``, ``kernels="inductor"``, or ``"auto"`` on CUDA). A stage has
up to six graphs (forward, full backward, its input-gradient and weight-gradient halves, the
F&B graphs of DualPipe's overlapped actions, the ``no_grad`` forward), and a schedule runs only
some of them: 1F1B never runs the I/W halves, ZB1P never runs the full backward. Each graph is
therefore compiled on its first call, from the example values its placeholders carry (never
from the call's tensors, so compiling does not depend on which micro-batch comes first); the
plan's kernels table and ``output_code`` gain its kernels then. Everything the training step
runs has been compiled by the end of the first step. The program passes work on the FX
graphs, so the kernels are made after them; the Program keeps its FX graphs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch

from zeroc.frontend.config import Config
from zeroc.frontend.session import CompiledGraph
from zeroc.frontend.stage_compiler import StageCompiler
from zeroc.passes.base import PassContext, graph_text, pass_infos, run_passes
from zeroc.passes.front.split_stages import StageSplit
from zeroc.passes.program.comm_lowering import comm_lowering, forward_only
from zeroc.passes.program.overlap_fb import OverlappedGraph, overlap_fb
from zeroc.passes.program.split_weight_grad import split_weight_grad
from zeroc.runtime.actions import Schedule
from zeroc.runtime.cost.cost import graph_info
from zeroc.runtime.program import (
    PipelineLayout,
    Program,
    StageProgram,
    StageSummary,
    frozen_mapping,
)

__all__ = ["PROGRAM_PASSES", "pipeline_program", "program_with_inductor", "run_program_passes",
           "stage_summaries"]

log = logging.getLogger(__name__)

# On the whole Program of a pp > 1 graph, after its stages compiled, in this order.
PROGRAM_PASSES = (
    split_weight_grad,
    overlap_fb,
    comm_lowering,
)

STAGE_GRAPHS = ("forward", "backward", "input_grad", "weight_grad")

# Graph kinds the program passes add that the plan lists (the F&B graphs it does not).
_LISTED_KINDS = ("input_grad", "weight_grad")


def param_name(flat: Any) -> str:
    """The model's name of a parameter's flat (or sharded) graph input."""
    return getattr(getattr(flat, "_zeroc_param", None), "param_name", "")


def stage_summaries(split: StageSplit, example_inputs: list[Any], params: set[int],
                    layout: Any) -> tuple[StageSummary, ...]:
    """One ``StageSummary`` per stage of ``split``: its modules, cost, activations, whole
    (unsharded: a ZeRO shard's numel is its share, not the parameter's) parameter sizes and
    names, and the bytes of the message it sends the next stage."""
    full_numel = {r.param_name: r.numel for r in getattr(layout, "params", ())}
    numel, nbytes = {}, {}
    for index in params:
        value = example_inputs[index]
        numel[index] = full_numel.get(param_name(value) or None, value.numel())
        nbytes[index] = numel[index] * value.element_size()
    last = len(split.stages) - 1
    return tuple(StageSummary(
        index=s.index, units=tuple(s.units), flops=s.flops, bytes=s.bytes,
        activation_bytes=s.activation_bytes,
        params=sum(numel[i] for i in s.param_inputs),
        param_bytes=sum(nbytes[i] for i in s.param_inputs),
        param_names=tuple(param_name(example_inputs[i]) for i in s.param_inputs),
        message_bytes=0 if s.index == last else sum(
            math.prod(split.values[k][0]) * split.values[k][1].itemsize
            for k in split.messages[s.index]))
        for s in split.stages)


def pipeline_program(prefix: str, stages: dict[int, StageProgram], schedule: Schedule,
                     layout: PipelineLayout, zero: Any, summaries: tuple[StageSummary, ...],
                     position_params: dict[int, frozenset[str]]) -> Program:
    """This rank's Program before the program passes: the stages' forward and backward
    graphs, the compute-only schedule (``layout``'s schedules are lowered by
    ``comm_lowering``)."""
    graphs = {}
    for index in sorted(stages):
        for kind in ("forward", "backward"):  # none in an evaluation program
            if getattr(stages[index], kind) is not None:
                graphs[f"{prefix}.s{index}.{kind}"] = getattr(stages[index], kind)
    return Program(name=prefix, graphs=frozen_mapping(graphs),
                   stages=tuple(stages[s] for s in sorted(stages)), schedule=schedule,
                   pipeline=layout, zero=zero, summaries=summaries,
                   position_params=frozen_mapping(position_params))


def compute_layout(schedule: Schedule, **fields: Any) -> PipelineLayout:
    """A ``PipelineLayout`` whose schedules are ``schedule`` and its forwards, before
    ``comm_lowering`` adds the p2p actions."""
    return PipelineLayout(schedule=schedule, forward_schedule=forward_only(schedule), **fields)


def run_program_passes(program: Program, config: Config, record: CompiledGraph,
                       device: torch.device, timed: bool = False) -> Program:
    """``PROGRAM_PASSES`` over ``program``, recorded as ``<prefix>.program`` in ``record``;
    the graphs they add that the plan lists are recorded in the program's order (``timed``:
    with their calls, for a planned world's step estimate)."""
    ctx = PassContext(config=config, graph_name=f"{program.name}.program", kind="program",
                      device=device)
    program, records = run_passes(program, ctx, PROGRAM_PASSES,
                                  record=config.record_graphs)
    record.passes.extend(pass_infos(records))
    listed = {g.name: g for g in record.graphs}
    for name, graph in program.graphs.items():
        kind = name.rpartition(".")[2]
        if kind in _LISTED_KINDS and name not in listed:
            listed[name] = graph_info(graph, name, kind, graph_text(graph), timed)
    order = {name: i for i, name in enumerate(program.graphs)}
    record.graphs[:] = sorted(listed.values(), key=lambda g: order.get(g.name, len(order)))
    return program


def program_with_inductor(program: Program, compiler: StageCompiler) -> Program:
    """``program`` whose stages run every graph through Inductor, each compiled on its first
    call (``LazyInductorGraph``; ``compiler``'s record gains its kernels then); the
    program's FX graphs stay as they are. Unchanged where ``compiler`` compiles no kernels."""
    if not compiler.compiles_kernels():
        return program
    stages = []
    for stage in program.stages:
        graphs = {kind: compiler.kernels(program.graphs[program.graph_name(stage.index, kind)],
                                         program.graph_name(stage.index, kind))
                  for kind in STAGE_GRAPHS
                  if program.graph_name(stage.index, kind) in program.graphs}
        overlapped = {}
        for b_stage, graph in stage.overlapped.items():
            assert isinstance(graph, OverlappedGraph)
            name = program.graph_name(stage.index, f"fb{b_stage}")
            overlapped[b_stage] = OverlappedGraph(compiler.kernels(graph.gm, name),
                                                  graph.num_forward_outputs)
        stages.append(dataclasses.replace(stage, overlapped=frozen_mapping(overlapped),
                                          **graphs))
    return dataclasses.replace(program, stages=tuple(stages))
