"""The pp > 1 compile path: one Dynamo graph -> stages -> per-stage graphs -> a train step.

``compile_pipeline`` is what the backend calls when the model's parameters carry a
``ZeroLayout`` with ``pp > 1`` (``zeroc.parallelize(model, pp=...)``):

1. The batch inputs (the tensors the user passed) are cut into micro-batches along dim 0 and
   the graph is re-shaped for one micro-batch (``passes/front/microbatch_shapes.py``).
2. The graph is cut into stages (``passes/front/split_stages.py``): ``pp`` stages, ``2 * pp`` for
   DualPipeV.
3. Each stage this rank holds gets its joint graph from AOTAutograd
   (``aot_export_joint_simple``, on fake tensors: ``zeroc.pipeline.stage_trace``) and is
   compiled by the one stage compiler (``zeroc.frontend.stage_compiler``, the same steps as at
   pp = 1): joint passes, forward/backward partition, graph passes, cross-rank check, records.
4. The stages and the schedule make a frozen ``Program`` (``zeroc.pipeline.program_build``);
   the program passes split each backward into I and W, build the F&B graphs of overlapped
   actions and lower the schedule with p2p actions; Inductor kernels where they run. The
   session holds that Program; a ``PipelineExecutor`` runs it inside a ``PipelinedStep``,
   numbering its calls with the model's one ``StepCounter`` (``STEPS_ATTR`` on its flat
   buffers: ``zeroc.runtime.pipeline.abort``).

Train-step mode (DESIGN.md §4.6): calling the compiled model runs the whole schedule. The loss
comes back from a ``torch.autograd.Function`` that kept the parameter gradients; its backward
multiplies them by the incoming gradient.

Evaluation. A graph Dynamo traced with gradients off (``torch.no_grad()``,
``torch.inference_mode()``; Dynamo guards on the grad mode, so it only ever runs so) is an
evaluation graph: its stages get forward-only graphs alone (no joint graph, no backward), its
schedule runs forwards only, and it returns the model's per-sample outputs (logits) whole on
every rank of the pipeline beside the loss (``zeroc.passes.front.loss_output``,
``zeroc.runtime.pipeline.outputs``), with or without a loss.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn

from zeroc.codegen.inductor_graphs import inductor_decompositions, kernel_path
from zeroc.frontend.config import Config
from zeroc.frontend.grad_coverage import check_stages
from zeroc.frontend.log_setup import CompileProgress, decisions
from zeroc.frontend.session import CompiledGraph, CompileSession
from zeroc.frontend.stage_compiler import StageCompiler
from zeroc.passes.base import graph_module
from zeroc.passes.front.specialize_shapes import size_inputs
from zeroc.passes.front.split_stages import StageSplit
from zeroc.pipeline import stage_reuse
from zeroc.pipeline.pipeline_front import FrontBuilt, pipeline_front, remember_sources
from zeroc.pipeline.pipelined_step import PipelinedStep
from zeroc.pipeline.program_build import (
    compute_layout,
    param_name,
    pipeline_program,
    program_with_inductor,
    run_program_passes,
    stage_summaries,
)
from zeroc.pipeline.stage_trace import (
    LazyInference,
    StageTrace,
    check_calling_convention,
    export_stage,
    sink_output_tokens,
)
from zeroc.runtime.layout import ZeroLayout
from zeroc.runtime.pipeline.abort import StepCounter
from zeroc.runtime.pipeline.executor import (
    PP_SOURCE_ATTR,
    PipelineExecutor,
    StageProgram,
)
from zeroc.runtime.world import PlannedWorld
from zeroc.sharding.stage_holding import keep_only

LAYOUT_ATTR = "_zeroc_layout"
STEPS_ATTR = "_zeroc_pp_steps"  # the model's StepCounter (runtime/pipeline/abort)

log = logging.getLogger(__name__)


class PipelineError(ValueError):
    """A model or option the pipeline cannot compile (reaches the user as a ValueError)."""


def pipeline_layout_of(example_inputs: list[Any]) -> ZeroLayout | None:
    """The layout ``zeroc.parallelize`` tagged on the graph's parameters, if it has pp > 1."""
    for value in example_inputs:
        layout = getattr(value, LAYOUT_ATTR, None) if isinstance(value, nn.Parameter) else None
        if layout is not None and layout.pp > 1:
            return layout
    return None


def compile_pipeline(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    config: Config,
    session: CompileSession,
    layout: ZeroLayout,
) -> Callable[..., Any]:
    """Compile one Dynamo graph of a pp > 1 model into a pipelined train step.

    A graph with dynamic sizes (Dynamo's answer to a second batch size) gets one static
    pipeline per distinct set of sizes, compiled on the first call that has them.
    """
    if size_inputs(example_inputs):
        return _PerSizePipelines(gm, config, session, layout)
    return _checked_compile(gm, example_inputs, config, session, layout)


def _checked_compile(gm: torch.fx.GraphModule | None, example_inputs: list[Any], config: Config,
                     session: CompileSession, layout: ZeroLayout,
                     dynamic_gm: torch.fx.GraphModule | None = None) -> Callable[..., Any]:
    try:
        return _compile_pipeline(gm, example_inputs, config, session, layout, dynamic_gm)
    except ValueError as error:
        if isinstance(error, PipelineError):
            raise
        raise PipelineError(str(error)) from None


class _PerSizePipelines:
    """Dispatch a dynamic-size graph's calls to a static pipeline compiled per size."""

    def __init__(self, gm: torch.fx.GraphModule, config: Config, session: CompileSession,
                 layout: ZeroLayout) -> None:
        self.gm, self.config, self.session, self.layout = gm, config, session, layout
        remember_sources(gm)  # the first compile happens on the first call
        self.compiled: dict[tuple[int, ...], Callable[..., Any]] = {}

    def __call__(self, *args: Any) -> Any:
        key = tuple(int(args[i]) for i in size_inputs(list(args)))
        step = self.compiled.get(key)
        if step is None:
            step = self.compiled[key] = _checked_compile(
                None, list(args), self.config, self.session, self.layout, dynamic_gm=self.gm)
        return step(*args)


def _compile_pipeline(
    gm: torch.fx.GraphModule | None,
    example_inputs: list[Any],
    config: Config,
    session: CompileSession,
    layout: ZeroLayout,
    dynamic_gm: torch.fx.GraphModule | None = None,
) -> Callable[..., Any]:
    """``gm``: the graph at the call's sizes (None: ``dynamic_gm`` specialized to them).
    ``dynamic_gm``: the same graph with a symbolic batch dimension, if Dynamo gave one: the
    stages are then traced from it at the micro-batch size; otherwise ``gm``'s batch-size
    constants are rewritten."""
    progress = CompileProgress(log, "pipeline")
    prefix = f"g{session.next_graph_index()}"
    progress.what = prefix
    evaluation = not torch.is_grad_enabled()  # Dynamo guards the graph on it
    front = pipeline_front(gm, example_inputs, config, layout, prefix, dynamic_gm, evaluation)
    shared = layout.planned.shared if layout.planned is not None else None
    if shared is not None and shared.front_only:  # the planned world's front: compile nothing
        raise FrontBuilt
    params, batch_inputs, batch = set(front.params), set(front.batch_inputs), front.batch
    microbatches, schedule, split = front.microbatches, front.schedule, front.split
    loss_output, normalization, names = front.loss_output, front.normalization, list(front.names)
    hoisted, microbatch = front.hoisted, front.microbatch
    pp = layout.pp
    record = CompiledGraph(prefix=prefix, params=front.param_infos, passes=list(front.passes))
    device = next((v.device for v in example_inputs if isinstance(v, torch.Tensor)),
                  torch.device("cpu"))
    position = layout.mesh.pp_index
    session.add(record)
    mine = [s for s, ranks in enumerate(schedule.placement) if position in ranks]
    # The hoisted parameters this position's stages read: the executor gathers these once
    # per step, and the stage graphs are traced on fake full-size ones (no device memory).
    read_here = {i for s in mine for i in split.stages[s].param_inputs}
    hoisted_here = {i: h for i, h in hoisted.items() if i in read_here}
    trace = StageTrace(example_inputs, hoisted_here,
                       read_here | {i for s in mine for i in split.stages[s].local_inputs})
    record.device = str(device)
    record.zero = layout.zero
    record.zero_group = layout.dp_group_name
    path = kernel_path(config.kernels, device)  # for the log line
    log.debug("zeroc: %s: traced and split into %d stages in %.2f s", prefix,
              schedule.num_stages, progress.lap())
    programs = {}
    # An evaluation's forward-only graphs are compiled now, before its Program exists.
    inference_graphs: dict[str, Any] = {}
    compiled_later = inference_graphs.__setitem__ if evaluation else functools.partial(
        session.add_graph, prefix)
    for k, s in enumerate(mine):
        progress.step("stage %d of %d on this rank (s%d of %d)", k + 1, len(mine), s,
                      schedule.num_stages)
        programs[s] = _compile_stage(split, s, trace, batch_inputs, batch // microbatches,
                                     config, record, names, device,
                                     compiled_later, layout.planned, evaluation)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("zeroc: %s.s%d compiled in %.2f s: %s", prefix, s, progress.lap(),
                      decisions(p for p in record.passes if p.graph.startswith(f"{prefix}.s{s}.")))
    # Parameters whose every reader's backward returns no gradient (read under no_grad, or
    # only through integer ops): they get none, as in eager, instead of zeros.
    without_gradient = frozenset() if evaluation else check_stages(
        front.split.stages, programs, front.differentiated,
        {i: names[i] for i in params if example_inputs[i].requires_grad})
    holders: dict[int, set[int]] = {}
    for spec in split.stages:
        for index in spec.param_inputs:
            holders.setdefault(index, set()).update(schedule.placement[spec.index])
    for index, positions in holders.items():
        setattr(example_inputs[index], PP_SOURCE_ATTR, min(positions))
    # A parameter no stage reads stays at position 0 (so checkpoints keep it).
    held_by = {p: [i for i in params if p in holders.get(i, {0})] for p in range(pp)}
    keep_only([example_inputs[i] for i in params], [example_inputs[i] for i in held_by[position]])
    position_params = {p: frozenset(param_name(example_inputs[i]) for i in indices)
                       for p, indices in held_by.items()}
    pipeline = compute_layout(
        schedule,
        messages=split.messages,
        values=split.values,
        batch_inputs=frozenset(batch_inputs),
        microbatch=batch // microbatches,
        holders={i: tuple(sorted(h)) for i, h in holders.items()},
        position=position,
        global_ranks=layout.mesh.pp_group_ranks,
        group_name=layout.mesh.pp_group_name,
        loss_kind=normalization.kind,
        loss_denominator=normalization.denominator,
        hoisted=hoisted_here,
        bucket_mb=config.bucket_mb,
        prefetch=config.prefetch,
        gather_quant=config.gather_quant,
        reduce_quant=config.reduce_quant,
        host_group_name=layout.mesh.pp_host_group_name,
        input_names={i: f"input {names[i]!r}" for i in batch_inputs},  # source names
        has_loss=loss_output.index is not None,
        outputs=loss_output.kept_specs,
    )
    program = pipeline_program(
        prefix, programs, schedule, pipeline, layout,
        stage_summaries(split, example_inputs, params, layout), position_params)
    for name, graph in inference_graphs.items():
        program = program.with_graph(name, graph)
    program = program_with_inductor(run_program_passes(program, config, record, device,
                                                       layout.planned is not None),
                                    StageCompiler(config, record, prefix, device, {},
                                                  zero_group=record.zero_group,
                                                  planned=layout.planned))
    executor = PipelineExecutor(program, layout.planned)  # the planned world's replay
    executor.counter = _model_steps([example_inputs[i] for i in params])
    step_buckets = []
    if executor.zero is not None:  # ZeRO once per step: the plan lists the step's buckets
        step_buckets = executor.zero.collectives(example_inputs, f"{prefix}.step")
        record.collectives.extend(step_buckets)
    # The session holds the Program that runs (with the step's collectives) and what runs it.
    session.set_program(dataclasses.replace(program, collectives=tuple(step_buckets)), executor)
    grad_inputs = () if evaluation else tuple(sorted(
        i for i in params if example_inputs[i].requires_grad and i not in without_gradient))
    if log.isEnabledFor(logging.INFO):
        log.info("zeroc: %s compiled in %.2f s (%s kernels): pipeline of %d stages, s%s on this "
                 "rank (position %d of %d); schedule %s, %d micro-batches of %d, %d actions "
                 "here; per-step ZeRO buckets: %d gathers, %d reductions; %s", prefix,
                 progress.elapsed(), path, schedule.num_stages, ", s".join(map(str, mine)),
                 position + 1, pp, schedule.name, microbatches, microbatch,
                 len(schedule.actions[position]),
                 sum(c.op == "all_gather" for c in step_buckets),
                 sum(c.op != "all_gather" for c in step_buckets), decisions(record.passes))
    return PipelinedStep(executor, grad_inputs, loss_output)


def _model_steps(flat_params: list[Any]) -> StepCounter:
    """The model's one ``StepCounter`` (every compiled graph of it shares it), kept on its
    flat buffers like ``PP_SOURCE_ATTR``: a call of any of them is the model's next step."""
    counter = next((c for p in flat_params if isinstance(
        c := getattr(p, STEPS_ATTR, None), StepCounter)), None) or StepCounter()
    for param in flat_params:
        setattr(param, STEPS_ATTR, counter)
    return counter


def _example_args(split: StageSplit, index: int, trace: StageTrace, batch_inputs: set[int],
                  microbatch: int) -> list[torch.Tensor]:
    spec = split.stages[index]
    inputs = trace.inputs
    args = [inputs[i] for i in spec.param_inputs]
    args += [inputs[i][:microbatch] if i in batch_inputs else inputs[i]
             for i in spec.local_inputs]
    for key in spec.in_keys:
        shape, dtype, requires_grad = split.values[key]
        args.append(trace.zeros(shape, dtype, args[0].device if args else None, requires_grad))
    return args


def _compile_stage(split: StageSplit, index: int, trace: StageTrace, batch_inputs: set[int],
                   microbatch: int, config: Config, record: CompiledGraph, names: list[str],
                   device: torch.device, compiled_later: Callable[..., None],
                   planned: PlannedWorld | None, evaluation: bool = False) -> StageProgram:
    """Stage ``index``'s graphs, traced on ``trace``'s fake tensors
    (``zeroc.pipeline.stage_trace``); ``compiled_later(name, graph)`` is told of its
    inference graph when the first ``no_grad`` call compiles it. ``evaluation``: the
    forward-only graph alone, compiled now."""
    with trace.tracing():
        return _traced_stage(split, index, trace, batch_inputs, microbatch, config, record,
                             names, device, compiled_later, planned, evaluation)


def _traced_stage(split: StageSplit, index: int, trace: StageTrace, batch_inputs: set[int],
                  microbatch: int, config: Config, record: CompiledGraph, names: list[str],
                  device: torch.device, compiled_later: Callable[..., None],
                  planned: PlannedWorld | None, evaluation: bool = False) -> StageProgram:
    """Stage ``index``'s joint graph from ``aot_export_joint_simple``, compiled by the one
    ``StageCompiler`` (joint passes, partition, graph passes, cross-rank check, records)."""
    spec = split.stages[index]
    args = _example_args(split, index, trace, batch_inputs, microbatch)
    primal_names = [names[i] for i in (*spec.param_inputs, *spec.local_inputs)] + list(
        spec.in_keys)
    compiler = StageCompiler(config, record, f"{record.prefix}.s{index}", device,
                             {f"primals_{i + 1}": n for i, n in enumerate(primal_names)},
                             zero_group=record.zero_group, compiled_later=compiled_later,
                             planned=planned)
    shared = planned.shared if planned is not None else None  # the planned world's stages
    # Inductor lowers the graphs traced with its own decompositions (zeroc's kernels need none).
    decompositions = inductor_decompositions() if compiler.path == "inductor" else None
    inference = LazyInference(spec.gm, args, trace, compiler.inference_now, decompositions)
    if evaluation:  # no joint graph, no backward: the forward-only graph, compiled now
        inference.compile()
        return StageProgram(
            index=index, forward=None, backward=None, param_inputs=spec.param_inputs,
            local_inputs=spec.local_inputs, in_keys=spec.in_keys, out_keys=spec.out_keys,
            num_model_outputs=spec.num_model_outputs, inference=inference)
    key = stage_reuse.signature(split, index, args) if shared is not None else None
    reused = stage_reuse.find(key, split, index, record, inference, shared)
    if reused is not None:
        return reused
    before = stage_reuse.counts(record)
    with torch.enable_grad(), trace.mode:  # a no_grad recompile still builds these graphs
        joint, tokens = export_stage(spec.gm, args, trace_joint=True,
                                     decompositions=decompositions)
    primals = [n.name for n in joint.graph.find_nodes(op="placeholder")
               if not n.name.startswith("tangents")]
    compiler.input_names.clear()  # the placeholders' names once tokens are taken out
    compiler.input_names.update(zip(primals, primal_names, strict=True))
    # The passes recompile each graph after each pass; its code is made once, when it runs.
    joint = compiler.joint(graph_module(joint, joint.graph), keep_graph=False)
    num_fwd = len(spec.out_keys) + spec.num_model_outputs
    # Effect tokens stay forward outputs through the partition (the effect stays in the
    # forward graph), then go to the forward's sink (``zeroc.pipeline.stage_trace``).
    fw, bw = compiler.partition(joint, args, num_fwd_outputs=num_fwd + tokens)
    sink_output_tokens(fw, tokens)
    check_calling_convention(fw, len(args), num_fwd, f"stage {index} forward")
    fw, _ = compiler.graph(graph_module(fw, fw.graph), "forward")
    bw, _ = compiler.graph(graph_module(bw, bw.graph), "backward")
    tangent_outputs = tuple(i for i, flag in enumerate(spec.output_requires_grad) if flag)
    tangents = sum(1 for n in joint.graph.nodes
                   if n.op == "placeholder" and n.name.startswith("tangents"))
    if tangents != len(tangent_outputs):
        raise ValueError(f"zeroc pipeline: stage {index} has {tangents} output gradients in its "
                         f"joint graph but {len(tangent_outputs)} outputs that require one")
    program = StageProgram(
        index=index, forward=fw, backward=bw, param_inputs=spec.param_inputs,
        local_inputs=spec.local_inputs, in_keys=spec.in_keys, out_keys=spec.out_keys,
        num_model_outputs=spec.num_model_outputs, tangent_outputs=tangent_outputs,
        inference=inference)
    stage_reuse.keep(key, program, record, before, shared)
    return program
