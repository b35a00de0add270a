"""The first half of a pipeline compile, the same on every pipeline position.

From one Dynamo graph at the call's sizes (and, when Dynamo gave one, the same graph with a
symbolic batch dimension) ``pipeline_front`` makes what every position of the pipeline
compiles from: the loss output, the batch inputs and the micro-batch count, the schedule,
the Dynamo graph's passes, the loss normalization (a loss that is no sum over samples is
refused first, from the symbolic graph: ``passes/front/loss_output.check_sum_over_samples``), the
parameter gathers taken out of the graph (ZeRO once per step), and the graph cut into stages
at the micro-batch size.
``zeroc.pipeline.pipeline_capture`` then compiles the stages one position holds.

Every transform of a graph here is a pass run by ``run_passes`` from the literal lists of
``zeroc.passes.pipeline`` (``SPECIALIZE_PASSES`` ... ``STAGE_PASSES``) with a
``zeroc.passes.front.context.FrontContext``, which carries what the passes read and what they
publish (the loss output, the normalization, the hoisted gathers, the ``StageSplit``). Their
records are the front's rows of the plan's pass table: ``<prefix>.front`` for the graph at
the call's sizes, ``<prefix>.microbatch`` for the graph whose stages are compiled, and
``<prefix>.dynamo`` for the Dynamo passes of the latter.

Nothing here depends on which position compiles, apart from the name of the data-parallel
group the hoisted gathers use. A planned world (``zeroc.explain(model, inputs, world=...)``)
plans every position in one process from one Dynamo graph (``zeroc.world.plan_capture``), so it
keeps each front it made in ``SharedPlanning.fronts`` and the next position takes it, with its own
group name, instead of specializing, running the passes and splitting the same graph again.
A front whose stage graphs still name a process group (``pp_reshard``: the gathers stay in the
stages) is not shared.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx
from torch import nn

from zeroc.frontend.capture import SOURCE_NAME_META, parameter_infos, run_dynamo_passes, source_name
from zeroc.frontend.config import Config
from zeroc.frontend.grad_coverage import differentiated_inputs
from zeroc.frontend.session import CompiledGraph
from zeroc.passes.base import pass_infos, run_passes
from zeroc.passes.front.context import FrontContext
from zeroc.passes.front.hoist_unshard import HoistedParam
from zeroc.passes.front.loss_output import LossOutput, check_sum_over_samples
from zeroc.passes.front.specialize_shapes import OUTPUTS_ONLY, microbatch_inputs
from zeroc.passes.front.split_stages import StageSplit
from zeroc.passes.pipeline import (
    HOIST_PASSES,
    LOSS_PASSES,
    NORMALIZE_PASSES,
    SPECIALIZE_OUTPUTS_PASSES,
    SPECIALIZE_PASSES,
    STAGE_PASSES,
)
from zeroc.passes.program.schedule import build_schedule
from zeroc.pipeline.front_errors import check_one_graph, cut_failed
from zeroc.pipeline.stage_trace import full_size_fakes
from zeroc.runtime.actions import Schedule
from zeroc.runtime.layout import ZeroLayout
from zeroc.runtime.plan.records import ParamInfo, PassInfo
from zeroc.runtime.torch_compat import (
    OpOverload,
    OpOverloadPacket,
    tree_flatten,
)
from zeroc.runtime.world import SharedPlanning

__all__ = ["GROUP_NAMESPACES", "SHARED_TRACE_META", "FrontBuilt", "PipelineFront",
           "default_microbatches",
           "front_is_shared", "op_namespace", "pipeline_front", "remember_sources",
           "shared_front"]

# In a graph's ``meta``: the Dynamo graph it copies, when a planned world's positions share
# one trace (``zeroc.world.plan_capture``) and each gets a copy naming its own process groups.
SHARED_TRACE_META = "zeroc_shared_trace"

# Namespaces of the ops that take a process group by name.
GROUP_NAMESPACES = ("zeroc", "_c10d_functional", "c10d_functional")


def default_microbatches(schedule: str, pp: int) -> int:
    """Micro-batches when the user gives none: the stages, or the schedule's minimum."""
    stages = 2 * pp if schedule == "dualpipev" else pp
    return max(stages, 2 * pp) if schedule in ("dualpipe", "dualpipev") else stages


def evaluation_microbatches(batch: int, microbatches: int, schedule: str, pp: int) -> int:
    """The micro-batch count of an evaluation whose batch ``microbatches`` does not divide:
    the divisor of ``batch`` the schedule accepts nearest to it (the fewer of two equally
    near), so a last, smaller batch evaluates as any other; ``microbatches`` if none does
    (the caller's error then names it). Only the forwards' pipelining depends on it."""
    fits = []
    for count in range(1, batch + 1):
        if batch % count == 0:
            try:
                build_schedule(schedule, pp, count)
            except ValueError:
                continue
            fits.append(count)
    return min(fits, key=lambda c: (abs(c - microbatches), c)) if fits else microbatches


USER_INPUT_META = "zeroc_user_input"


def _is_user_input(node: torch.fx.Node) -> bool:
    """Whether a placeholder is a tensor the caller passed (not a module's buffer or
    attribute): its Dynamo source is a local of the forward other than ``self``, reached
    without passing through a module. Read from Dynamo's ``grapharg``, or from what
    ``remember_sources`` kept of it (Dynamo drops ``grapharg`` once the backend returns)."""
    if USER_INPUT_META in node.meta:
        return node.meta[USER_INPUT_META]
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        return False
    text = source.name() if callable(source.name) else str(source.name)
    while getattr(source, "base", None) is not None:
        if "Module" in type(source).__name__ or "ParamBuffer" in type(source).__name__:
            return False
        source = source.base
    name = getattr(source, "local_name", None)
    return name is not None and name != "self" and not text.startswith("G[") and all(
        part not in text for part in ("._modules[", "._buffers[", "._parameters["))


def remember_sources(gm: torch.fx.GraphModule) -> None:
    """Keep what later compiles need of each placeholder's Dynamo source in its meta."""
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta[USER_INPUT_META] = _is_user_input(node)
            node.meta[SOURCE_NAME_META] = source_name(node)


def _batch_inputs(gm: torch.fx.GraphModule, inputs: list[Any], params: set[int],
                  unsplit: tuple[str, ...] = ()) -> tuple[set[int], int]:
    """The inputs cut into micro-batches (every user tensor input with a dimension, but those
    named in ``unsplit``) and the batch size they share."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # The user's tensor inputs with a dimension, by the forward's argument name.
    named = {source_name(n): i for i, (n, v) in enumerate(zip(placeholders, inputs,
                                                              strict=False))
             if i not in params and isinstance(v, torch.Tensor) and v.dim() > 0
             and _is_user_input(n)}
    unknown = [name for name in unsplit if name not in named]
    if unknown:
        raise ValueError(f"zeroc pipeline: unsplit_inputs names {unknown}, which the forward "
                         f"does not take as a tensor; its tensor inputs are {sorted(named)}")
    cut = {name: i for name, i in named.items() if name not in unsplit}
    batch = set(cut.values())
    sizes = {name: int(inputs[i].shape[0]) for name, i in sorted(cut.items(), key=lambda c: c[1])}
    if not sizes:
        raise ValueError("zeroc pipeline: the model takes no tensor input to cut into "
                         "micro-batches; pass the batch as tensors (batch in dimension 0)")
    if len(set(sizes.values())) != 1:
        raise ValueError(f"zeroc pipeline: every tensor input is cut into micro-batches along "
                         f"dimension 0, so they need one batch size; got {sizes}. Pass an "
                         "input that is not part of the batch whole with options="
                         "{'unsplit_inputs': ['name']}")
    return batch, next(iter(sizes.values()))


@dataclasses.dataclass(frozen=True)
class PipelineFront:
    """What every pipeline position compiles from (see the module docstring)."""

    params: frozenset[int]  # graph inputs that are parameters
    loss_output: LossOutput
    batch_inputs: frozenset[int]
    batch: int
    microbatches: int
    schedule: Schedule
    param_infos: tuple[ParamInfo, ...]
    passes: tuple[PassInfo, ...]  # ``<prefix>.front``, ``.dynamo`` and ``.microbatch`` rows
    normalization: Any
    names: tuple[str, ...]  # every graph input's source name
    hoisted: dict[int, HoistedParam]
    split: StageSplit
    dp_group_name: str  # the group ``hoisted`` gathers over
    # Trainable parameters eager's ``loss.backward()`` reaches (``zeroc.frontend.grad_coverage``);
    # None: Dynamo left no autograd metadata to read.
    differentiated: frozenset[int] | None = None

    @property
    def microbatch(self) -> int:
        return self.batch // self.microbatches

    def for_group(self, dp_group_name: str) -> PipelineFront:
        """This front for a position whose data-parallel group is ``dp_group_name``."""
        if dp_group_name == self.dp_group_name:
            return self
        hoisted = {i: dataclasses.replace(h, group_name=dp_group_name)
                   if h.group_name == self.dp_group_name else h for i, h in self.hoisted.items()}
        return dataclasses.replace(self, hoisted=hoisted, dp_group_name=dp_group_name)


class FrontBuilt(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by the pipeline compiler under ``SharedPlanning.front_only`` once the front is made
    and kept: a planned world builds what its positions share before planning any of them."""


def op_namespace(target: Any) -> str | None:
    """The op namespace of an FX target (``torch.ops.zeroc.unshard`` or its ``.default``)."""
    if isinstance(target, OpOverloadPacket):
        return target._qualified_op_name.split("::")[0]
    return target.namespace if isinstance(target, OpOverload) else None


def _group_name_arg(node: torch.fx.Node) -> str:
    """The process group ``node`` names: its op's ``group_name`` argument ("" if none, or
    for an op outside ``GROUP_NAMESPACES``). Other string arguments (a loss's ``reduction``,
    a reduce-scatter's ``reduce_op``) are not groups."""
    target = getattr(node.target, "default", node.target)  # a packet: its one overload
    schema = getattr(target, "_schema", None)
    if node.op != "call_function" or schema is None or (
            op_namespace(node.target) not in GROUP_NAMESPACES):
        return ""
    for index, argument in enumerate(schema.arguments):
        if argument.name == "group_name":
            value = node.args[index] if index < len(node.args) else node.kwargs.get(
                argument.name)
            return value if isinstance(value, str) else ""
    return ""


def _names_a_group(split: StageSplit) -> bool:
    """Whether a stage graph still calls an op that takes a process group's name."""
    return any(_group_name_arg(node) for spec in split.stages for node in spec.gm.graph.nodes)


def front_is_shared(dynamic_gm: torch.fx.GraphModule, shared: SharedPlanning | None) -> bool:
    """Whether a position of this planned world kept a front of ``dynamic_gm`` in ``shared``
    (then the graph is only a key: the front is taken with the asking position's group name)."""
    return shared is not None and id(dynamic_gm) in shared.front_graphs


def shared_front(shared: SharedPlanning) -> PipelineFront | None:
    """The one pipeline front kept in ``shared`` while a world is planned, if there is
    exactly one."""
    fronts = list(shared.fronts.values())
    return fronts[0] if len(fronts) == 1 else None


def pipeline_front(gm: torch.fx.GraphModule | None, example_inputs: list[Any], config: Config,
                   layout: ZeroLayout, prefix: str,
                   dynamic_gm: torch.fx.GraphModule | None = None,
                   evaluation: bool = False) -> PipelineFront:
    """The front of ``gm`` (the graph at the call's sizes; None: ``dynamic_gm`` specialized
    to them), taken from ``layout.planned.shared`` when a position of the same planned world made it
    already. ``dynamic_gm``: the same graph with a symbolic batch dimension, if Dynamo gave
    one: the stages are then traced from it at the micro-batch size; otherwise ``gm``'s
    batch-size constants are rewritten. ``evaluation``: the graph was traced with gradients
    off; it keeps its per-sample outputs (``zeroc.passes.front.loss_output``)."""
    planned = layout.planned
    shared = planned.shared if planned is not None else None
    key = None
    if shared is not None and dynamic_gm is not None:
        sizes = tuple(int(v) for v in example_inputs if isinstance(v, (int, torch.SymInt)))
        source = dynamic_gm.meta.get(SHARED_TRACE_META, dynamic_gm)
        key = (id(source), sizes, prefix, repr(config.to_dict()), evaluation)
        front = shared.fronts.get(key)
        if front is not None:
            return front.for_group(layout.dp_group_name)
    specializing = SPECIALIZE_PASSES if gm is None else ()
    if gm is None and planned is not None and planned.simulated:  # see _build: no full-batch graph
        specializing = SPECIALIZE_OUTPUTS_PASSES
    front = _build(gm, example_inputs, config, layout, prefix, dynamic_gm, specializing,
                   evaluation)
    if key is not None and not _names_a_group(front.split):
        shared.fronts[key] = front
        shared.front_graphs[id(source)] = source  # keeps the id unique
    return front


def _build(gm: torch.fx.GraphModule | None, example_inputs: list[Any], config: Config,
           layout: ZeroLayout, prefix: str, dynamic_gm: torch.fx.GraphModule | None,
           specializing: tuple, evaluation: bool = False) -> PipelineFront:
    """The front, its passes run by ``run_passes`` and recorded: ``<prefix>.front`` on the
    graph at the call's sizes (``specializing`` makes it from ``dynamic_gm`` when ``gm`` is
    None), ``<prefix>.microbatch`` on the graph whose stages are compiled, ``<prefix>.dynamo``
    (``run_dynamo_passes``) on the latter between them."""
    params = {i for i, v in enumerate(example_inputs) if isinstance(v, nn.Parameter)}
    rows: list[PassInfo] = []  # the front's pass table, in the order the passes ran

    def run(subject: torch.fx.GraphModule, ctx: FrontContext,
            passes: tuple) -> torch.fx.GraphModule:
        subject, records = run_passes(subject, ctx, passes, record=config.record_graphs)
        rows.extend(pass_infos(records))
        return subject

    full = FrontContext(config=config, graph_name=f"{prefix}.front", kind="front",
                        inputs=example_inputs, params=params, evaluation=evaluation)
    if gm is None:
        gm = run(dynamic_gm, full, specializing)
    check_one_graph(gm, layout, params, dynamic_gm if dynamic_gm is not None else gm,
                    example_inputs)
    batch_inputs, batch = _batch_inputs(gm, example_inputs, params, config.unsplit_inputs)
    full.batch_inputs, full.traced_batch = batch_inputs, batch
    gm = run(gm, full, LOSS_PASSES)
    differentiated = None if evaluation else _differentiated(gm, dynamic_gm, full.loss_output)
    if config.loss_reduction is None and dynamic_gm is not None \
            and full.loss_output.index is not None:  # a per-sample loss
        check_sum_over_samples(dynamic_gm, full.loss_output.index, batch_inputs)
    pp = layout.pp
    microbatches = config.microbatches or default_microbatches(config.schedule, pp)
    if batch % microbatches and evaluation:  # an evaluation batch of its own size
        microbatches = evaluation_microbatches(batch, microbatches, config.schedule, pp)
    if batch % microbatches:
        raise ValueError(
            f"zeroc pipeline: microbatches={microbatches} does not divide the batch of "
            f"{batch}; use a batch that is a multiple of {microbatches} or a microbatches "
            f"option that divides {batch}"
        )
    try:
        schedule = build_schedule(config.schedule, pp, microbatches)
    except ValueError as error:
        raise ValueError(f"zeroc pipeline: schedule={config.schedule!r} with pp={pp} and "
                         f"microbatches={microbatches}: {error}") from None
    record = CompiledGraph(prefix=prefix, params=parameter_infos(gm, example_inputs))
    device = next((v.device for v in example_inputs if isinstance(v, torch.Tensor)),
                  torch.device("cpu"))
    microbatch = batch // microbatches
    micro_inputs = None if dynamic_gm is None else microbatch_inputs(
        dynamic_gm, example_inputs, batch_inputs, microbatch)
    if micro_inputs is None and gm.meta.get(OUTPUTS_ONLY):  # the full-batch graph is needed
        rows.clear()  # the outputs-only copy is dropped, and the rows of its passes with it
        gm = run(run(dynamic_gm, full, SPECIALIZE_PASSES), full, LOSS_PASSES)
    loss_output = full.loss_output
    # Stage graphs are always traced for training (a no_grad call runs their forwards only).
    # The full-batch graph gets the passes too, even when the stages come from the
    # micro-batch graph: the loss normalization reads the loss as the passes leave it
    # (Hugging Face's loss call is only recognised after them), and its denominator is
    # computed from the full-batch inputs. A planned world never computes the denominator
    # (``zeroc.runtime.pipeline.sync``: there are no values) and reads only the
    # normalization's kind, which the micro-batch graph, the same nodes at other sizes, gives:
    # its full-batch graph is a copy that was never run (``specialize_outputs``).
    # A full-batch graph that is not cut keeps its Dynamo passes' rows out of the table
    # (``<prefix>.dynamo`` is the graph the stages come from).
    if not gm.meta.get(OUTPUTS_ONLY):
        full_gm = run_dynamo_passes(gm, config, record if micro_inputs is None else
                                    CompiledGraph(prefix=prefix, params=()), device,
                                    need_grad=True)
        rows.extend(record.passes)  # none when the graph is not cut
        # The loss becomes a sum per micro-batch; the step divides once by the whole
        # batch's denominator.
        full_gm = run(full_gm, full, NORMALIZE_PASSES)
    names = [source_name(n) for n in gm.graph.nodes if n.op == "placeholder"]
    cut = FrontContext(config=config, graph_name=f"{prefix}.microbatch", kind="front",
                       params=params, names=names, batch_inputs=batch_inputs,
                       microbatch=microbatch, num_stages=schedule.num_stages,
                       evaluation=evaluation, kept_outputs=loss_output.kept)
    if micro_inputs is None:  # a static graph: its batch-size constants are rewritten
        gm, cut.traced_batch = full_gm, batch
    else:  # traced at the micro-batch size: nothing to rewrite
        cut.inputs, cut.costs, cut.traced_batch = micro_inputs, True, microbatch
        try:
            gm = run(dynamic_gm, cut, SPECIALIZE_PASSES)
        except RuntimeError as error:
            raise cut_failed(error, dynamic_gm, batch_inputs, batch, microbatch) from None
        gm = run(gm, cut, LOSS_PASSES)
        gm = run_dynamo_passes(gm, config, record, device, need_grad=True)
        rows.extend(record.passes)
        gm = run(gm, cut, NORMALIZE_PASSES)
    normalization = full.normalization or dataclasses.replace(cut.normalization,
                                                              denominator=None)
    # ZeRO once per step: the stage graphs read and differentiate full parameters.
    gm = run(gm, cut, HOIST_PASSES)
    cut.fake_inputs = full_size_fakes(example_inputs, cut.hoisted)
    try:
        run(gm, cut, STAGE_PASSES)
    except RuntimeError as error:
        raise cut_failed(error, gm, batch_inputs, batch, microbatch) from None
    return PipelineFront(
        params=frozenset(params), loss_output=loss_output, batch_inputs=frozenset(batch_inputs),
        batch=batch, microbatches=microbatches, schedule=schedule, param_infos=record.params,
        passes=tuple(rows),
        normalization=normalization, names=tuple(names), hoisted=cut.hoisted, split=cut.split,
        dp_group_name=layout.dp_group_name, differentiated=differentiated)


def _differentiated(gm: torch.fx.GraphModule, dynamic_gm: torch.fx.GraphModule | None,
                    loss_output: LossOutput) -> frozenset[int] | None:
    """The inputs eager's backward from the loss reaches, read from the graph as Dynamo
    traced it (``gm`` now returns the loss alone; ``dynamic_gm``, if given, is unchanged)."""
    if dynamic_gm is None:
        return differentiated_inputs(gm)
    output = next(n for n in dynamic_gm.graph.nodes if n.op == "output")
    if len(tree_flatten(output.args[0])[0]) != loss_output.count:
        return None
    return differentiated_inputs(dynamic_gm, [loss_output.index])
