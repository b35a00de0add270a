"""The pp > 1 compile path: one Dynamo graph -> stages -> per-stage graphs -> a train step.

``compile_pipeline`` is what the backend calls when the model's parameters carry a
``ZeroLayout`` with ``pp > 1`` (``zeroc.parallelize(model, pp=...)``):

1. The batch inputs (the tensors the user passed) are cut into micro-batches along dim 0 and
   the graph is re-shaped for one micro-batch (``passes/microbatch_shapes.py``).
2. The graph is cut into stages (``passes/split_stages.py``): ``pp`` stages, ``2 * pp`` for
   DualPipeV.
3. Each stage this rank holds gets its joint graph from AOTAutograd
   (``aot_export_joint_simple``, on fake tensors: ``zeroc.pipeline.stage_trace``), the joint passes,
   the forward/backward partition and the graph passes (ZeRO lowering, fusion), and its
   backward is split into I and W
   (``passes/split_weight_grad.py``); F&B graphs are built for overlapped actions
   (``passes/overlap_fb.py``).
4. The schedule is built and lowered with p2p actions; the result is a ``PipelinedStep``.

Train-step mode (DESIGN.md §4.6): calling the compiled model runs the whole schedule. The loss
comes back from a ``torch.autograd.Function`` that kept the parameter gradients; its backward
multiplies them by the incoming gradient. Under ``torch.no_grad()`` only forwards run.
"""

from __future__ import annotations

import dataclasses
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
from zeroc.passes.base import PassContext, graph_module, graph_text, pass_infos, run_passes
from zeroc.passes.comm_lowering import lower_communication
from zeroc.passes.overlap_fb import overlap_forward_backward
from zeroc.passes.pipeline import JOINT_PASSES, graph_passes
from zeroc.passes.specialize_shapes import size_inputs
from zeroc.passes.split_stages import StageSplit
from zeroc.passes.split_weight_grad import split_weight_grad
from zeroc.pipeline import stage_reuse
from zeroc.pipeline.pipeline_front import FrontBuilt, pipeline_front, remember_sources
from zeroc.pipeline.pipelined_step import PipelinedStep
from zeroc.pipeline.stage_kernels import compile_stages_with_inductor, inductor_after
from zeroc.pipeline.stage_trace import LazyInference, StageTrace
from zeroc.runtime.actions import ActionKind, Schedule
from zeroc.runtime.consistency import check_same_graph
from zeroc.runtime.cost.cost import graph_info, tensor_bytes
from zeroc.runtime.pipeline_executor import (
    PP_SOURCE_ATTR,
    PipelineExecutor,
    PipelineLayout,
    StageProgram,
)
from zeroc.runtime.planning_state import PLANNING
from zeroc.runtime.torch_compat import (
    aot_export_joint_simple,
    default_partition,
    min_cut_rematerialization_partition,
)
from zeroc.runtime.zero_ops import ZeroLayout
from zeroc.sharding.stage_holding import keep_only

LAYOUT_ATTR = "_zeroc_layout"

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


@dataclasses.dataclass
class PipelineRecord:
    """What the plan shows about a pipelined compile (kept on the session)."""

    split: StageSplit
    schedule: Schedule
    layout: ZeroLayout
    executor: PipelineExecutor
    stage_params: dict[int, int]
    stage_param_bytes: dict[int, int]
    # Pipeline position -> names of the parameters its ranks hold.
    position_params: dict[int, frozenset[str]] = dataclasses.field(default_factory=dict)
    stage_param_names: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)


def _param_name(flat: Any) -> str:
    return getattr(getattr(flat, "_zeroc_param", None), "param_name", "")


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
    front = pipeline_front(gm, example_inputs, config, layout, prefix, dynamic_gm)
    if PLANNING.front_only:  # a planned world built its shared front: nothing to compile
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
    path = kernel_path(config.kernels, device)
    log.debug("zeroc: %s: traced and split into %d stages in %.2f s", prefix,
              schedule.num_stages, progress.lap())
    programs = {}
    for k, s in enumerate(mine):
        progress.step("stage %d of %d on this rank (s%d of %d)", k + 1, len(mine), s,
                      schedule.num_stages)
        programs[s] = _compile_stage(split, s, trace, batch_inputs, batch // microbatches,
                                     config, record, names, device, path)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("zeroc: %s.s%d compiled in %.2f s: %s", prefix, s, progress.lap(),
                      decisions(p for p in record.passes if p.graph.startswith(f"{prefix}.s{s}.")))
    # Parameters whose every reader's backward returns no gradient (read under no_grad, or
    # only through integer ops): they get none, as in eager, instead of zeros.
    without_gradient = check_stages(
        front.split.stages, programs, front.differentiated,
        {i: names[i] for i in params if example_inputs[i].requires_grad})
    if any(a.kind is ActionKind.FB for a in schedule.actions[position]):
        for a in schedule.actions[position]:
            if a.kind is ActionKind.FB and a.b_stage not in programs[a.stage].overlapped:
                programs[a.stage].overlapped[a.b_stage] = overlap_forward_backward(
                    programs[a.stage], programs[a.b_stage])
    if path == "inductor" and not PLANNING.simulated:  # planning runs the graphs on fakes
        compile_stages_with_inductor(programs, record, config.kernel_autotune)
    holders: dict[int, set[int]] = {}
    for spec in split.stages:
        for index in spec.param_inputs:
            holders.setdefault(index, set()).update(schedule.placement[spec.index])
    for index, positions in holders.items():
        setattr(example_inputs[index], PP_SOURCE_ATTR, min(positions))
    # A parameter no stage reads stays at position 0 (so checkpoints keep it).
    held_by = {p: [i for i in params if p in holders.get(i, {0})] for p in range(pp)}
    keep_only([example_inputs[i] for i in params], [example_inputs[i] for i in held_by[position]])
    position_params = {p: frozenset(_param_name(example_inputs[i]) for i in indices)
                       for p, indices in held_by.items()}
    executor = PipelineExecutor(
        PipelineLayout(
            schedule=lower_communication(schedule),
            forward_schedule=lower_communication(_forward_only(schedule)),
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
            host_group_name=layout.mesh.pp_host_group_name,
            input_names={i: f"input {names[i]!r}" for i in batch_inputs},  # source names
        ),
        programs,
    )
    step_buckets = []
    if executor.zero is not None:  # ZeRO once per step: the plan lists the step's buckets
        step_buckets = executor.zero.collectives(example_inputs, f"{prefix}.step")
        record.collectives.extend(step_buckets)
    # Full (unsharded) sizes: a ZeRO shard's numel is its share, not the parameter's.
    records = getattr(layout, "params", ())
    full_numel = {r.param_name: r.numel for r in records}
    layout_numel, layout_bytes = {}, {}
    for index in params:
        value = example_inputs[index]
        record_name = getattr(getattr(value, "_zeroc_param", None), "param_name", None)
        numel = full_numel.get(record_name, value.numel())
        layout_numel[index] = numel
        layout_bytes[index] = numel * value.element_size()
    session.pipeline = PipelineRecord(  # type: ignore[attr-defined]
        split=split, schedule=schedule, layout=layout, executor=executor,
        stage_params={s.index: sum(layout_numel[i] for i in s.param_inputs)
                      for s in split.stages},
        stage_param_bytes={s.index: sum(layout_bytes[i] for i in s.param_inputs)
                           for s in split.stages},
        position_params=position_params,
        stage_param_names={s.index: tuple(_param_name(example_inputs[i])
                                          for i in s.param_inputs) for s in split.stages})
    grad_inputs = tuple(sorted(i for i in params if example_inputs[i].requires_grad
                               and i not in without_gradient))
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


def _forward_only(schedule: Schedule) -> Schedule:
    """The forwards of ``schedule`` in the same per-rank order (for ``torch.no_grad()``)."""
    return schedule.replace_actions(tuple(
        tuple(part for a in rank_actions for part in a.parts() if part.kind is ActionKind.F)
        for rank_actions in schedule.actions))


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
                   device: torch.device, path: str) -> StageProgram:
    """Stage ``index``'s graphs, traced on ``trace``'s fake tensors
    (``zeroc.pipeline.stage_trace``)."""
    with trace.tracing():
        return _traced_stage(split, index, trace, batch_inputs, microbatch, config, record,
                             names, device, path)


def _traced_stage(split: StageSplit, index: int, trace: StageTrace, batch_inputs: set[int],
                  microbatch: int, config: Config, record: CompiledGraph, names: list[str],
                  device: torch.device, path: str) -> StageProgram:
    spec = split.stages[index]
    args = _example_args(split, index, trace, batch_inputs, microbatch)
    # Inductor lowers the graphs traced with its own decompositions (zeroc's kernels need none).
    decompositions = inductor_decompositions() if path == "inductor" else None
    stage_name = f"{record.prefix}.s{index}"
    primal_names = [names[i] for i in (*spec.param_inputs, *spec.local_inputs)] + list(
        spec.in_keys)
    input_names = {f"primals_{i + 1}": n for i, n in enumerate(primal_names)}

    def passes(graph: torch.fx.GraphModule, kind: str, pipeline: tuple) -> torch.fx.GraphModule:
        name = f"{stage_name}.{kind}"
        ctx = PassContext(config=config, graph_name=name, kind=kind, device=device,
                          extras={"input_names": input_names})
        graph, pass_records = run_passes(graph, ctx, pipeline, record=config.record_graphs)
        record.passes.extend(pass_infos(pass_records))
        record.kernels.extend(ctx.kernels)
        record.collectives.extend(ctx.collectives)
        if kind != "joint":
            text = graph_text(graph)
            # The stage's data-parallel ranks compiled it alike, or all raise (as at pp=1).
            check_same_graph(name, text, record.zero_group, device)
            record.graphs.append(graph_info(graph, name, kind, text))
        return graph

    def inference_passes(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return passes(graph, "inference", graph_passes(path))

    inference = LazyInference(
        spec.gm, args, trace, inference_passes if path != "inductor" or PLANNING.simulated else
        inductor_after(inference_passes, f"{stage_name}.inference", record,
                       config.kernel_autotune),
        decompositions)
    key = stage_reuse.signature(split, index, args) if PLANNING.shared is not None else None
    reused = stage_reuse.find(key, split, index, record, inference)
    if reused is not None:
        return reused
    before = stage_reuse.counts(record)
    with torch.enable_grad(), trace.mode:  # a no_grad recompile still builds these graphs
        joint = aot_export_joint_simple(spec.gm, args, trace_joint=True,
                                        decompositions=decompositions)
    # The passes recompile each graph after each pass; its code is made once, when it runs.
    joint = passes(graph_module(joint, joint.graph), "joint", JOINT_PASSES)
    num_fwd = len(spec.out_keys) + spec.num_model_outputs
    partition = (min_cut_rematerialization_partition if config.partitioner == "min_cut"
                 else default_partition)
    fw, bw = partition(joint, args, num_fwd_outputs=num_fwd)
    fw = passes(graph_module(fw, fw.graph), "forward", graph_passes(path))
    bw = passes(graph_module(bw, bw.graph), "backward", graph_passes(path))
    output = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    record.saved_bytes += sum(tensor_bytes(n.meta.get("val"))
                              for n in output.args[0][num_fwd:] if isinstance(n, torch.fx.Node))
    split_bw = split_weight_grad(bw, len(spec.param_inputs))
    for kind, graph in (("input_grad", split_bw.input_grad), ("weight_grad", split_bw.weight_grad)):
        record.graphs.append(graph_info(graph, f"{stage_name}.{kind}", kind, graph_text(graph)))
    tangent_outputs = tuple(i for i, flag in enumerate(spec.output_requires_grad) if flag)
    tangents = sum(1 for n in joint.graph.nodes
                   if n.op == "placeholder" and n.name.startswith("tangents"))
    if tangents != len(tangent_outputs):
        raise ValueError(f"zeroc pipeline: stage {index} has {tangents} output gradients in its "
                         f"joint graph but {len(tangent_outputs)} outputs that require one")
    program = StageProgram(
        inference=inference, index=index, forward=fw, backward=bw,
        input_grad=split_bw.input_grad, weight_grad=split_bw.weight_grad,
        w_inputs=split_bw.w_inputs, num_input_grads=split_bw.num_input_grads,
        param_inputs=spec.param_inputs, local_inputs=spec.local_inputs, in_keys=spec.in_keys,
        out_keys=spec.out_keys, num_model_outputs=spec.num_model_outputs,
        tangent_outputs=tangent_outputs,
    )
    stage_reuse.keep(key, program, record, before)
    return program
