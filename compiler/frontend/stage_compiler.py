"""The one stage compiler: joint passes -> partition -> graph passes -> kernels -> records.

Both compile paths compile their graphs here, so the steps cannot drift apart:

- pp = 1 (``zeroc.frontend.capture``): AOTAutograd traces the Dynamo graph and calls back
  ``joint`` + ``partition`` (its ``partition_fn``) and ``graph`` + ``kernels`` (its forward,
  backward and inference compilers); AOTAutograd's runtime wrapper keeps eager semantics.
- pp > 1 (``zeroc.pipeline.pipeline_capture``): each stage's joint graph comes from
  ``aot_export_joint_simple`` and the same four steps run on it, per stage.

A ``StageCompiler`` compiles the graphs named ``<name>.<kind>`` (``g0.forward``,
``g0.s1.backward``): ``joint`` runs the joint passes, ``partition`` splits the joint graph into
forward and backward, ``graph`` runs the graph passes on one functional graph, checks that
every rank of its data-parallel group compiled the same text, and records it (graph, passes,
kernels, collectives, saved bytes) in the ``CompiledGraph``; ``kernels`` gives the graph's
Inductor-compiled form when ``kernel_path`` says so (never while planning on fake tensors:
planning runs the graphs themselves, and compiled code needs values).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from zeroc.codegen.inductor_graphs import InductorGraph, kernel_path
from zeroc.frontend.config import Config
from zeroc.frontend.session import CompiledGraph
from zeroc.passes.base import PassContext, graph_text, pass_infos, run_passes
from zeroc.passes.pipeline import JOINT_PASSES, graph_passes
from zeroc.passes.secondary_shard import keep_read_secondary_shards
from zeroc.runtime.consistency import check_same_graph, collective_text
from zeroc.runtime.cost.cost import graph_info, tensor_bytes
from zeroc.runtime.plan.records import PassInfo
from zeroc.runtime.quant.reduce import ResidualScope
from zeroc.runtime.secondary_shard import SECONDARY_SHARD, comparable_text
from zeroc.runtime.torch_compat import default_partition, min_cut_rematerialization_partition
from zeroc.runtime.world import PlannedWorld

__all__ = ["LazyInductorGraph", "StageCompiler", "zero_markers"]

log = logging.getLogger(__name__)


def zero_markers(graph: torch.fx.GraphModule) -> tuple[int, str]:
    """The ZeRO stage and data-parallel group of a graph's markers; ``(-1, "")`` if none."""
    found = []
    for node in graph.graph.nodes:
        if node.target is torch.ops.zeroc.unshard.default:
            found.append((node.args[4], node.args[3]))
        elif node.target is torch.ops.zeroc.reduce_grad.default:
            found.append((node.args[3], node.args[2]))
    if not found:
        return -1, ""
    return max(stage for stage, _ in found), found[0][1]


def _record_inductor(record: CompiledGraph, compiled: InductorGraph, name: str) -> None:
    """The plan's records of one Inductor-compiled graph: kernels, output code, order."""
    record.kernels.extend(compiled.kernels)
    record.output_code[name] = compiled.source_code
    if not compiled.collectives_kept:
        record.collectives_moved.append(name)


class LazyInductorGraph:
    """``gm`` compiled by Inductor on its first call, from the example values its placeholders
    carry (never from the call's tensors); called like ``gm``."""

    def __init__(self, gm: torch.fx.GraphModule, name: str, record: CompiledGraph,
                 autotune: bool = False) -> None:
        self.gm: torch.fx.GraphModule | None = gm
        self.autotune = autotune
        self.name = name
        self.record = record
        self.compiled: InductorGraph | None = None

    def _compile(self) -> InductorGraph:
        assert self.gm is not None
        log.info("zeroc: compiling %s with Inductor", self.name)
        compiled = InductorGraph(self.gm, self.name, autotune=self.autotune)
        _record_inductor(self.record, compiled, self.name)
        self.record.changed()  # the Program, set before this first call, gets the kernels
        self.gm = None  # the compiled code is all that runs from now on
        return compiled

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            self.compiled = self._compile()
        return self.compiled.run_boxed(list(args))


@dataclasses.dataclass
class StageCompiler:
    """Compiles the graphs of one stage (pp = 1: of one Dynamo graph) into ``record``.

    ``name`` prefixes the graph names (``g0``, ``g0.s1``); ``input_names`` maps AOTAutograd's
    ``primals_<i>`` to readable names for the passes; ``zero_group`` is the data-parallel
    group whose ranks must compile the same graphs (``None``: read from each graph's ZeRO
    markers, which then also set the record's ZeRO stage and group, as at pp = 1);
    ``zero_stage_hint`` is the model layout's ZeRO stage when it has one.
    """

    config: Config
    record: CompiledGraph
    name: str
    device: torch.device
    input_names: dict[str, str]
    zero_group: str | None = None
    zero_stage_hint: int | None = None
    num_fwd_outputs: int = 0
    # Called with (name, graph) for a graph compiled after its Program was built (pp > 1's
    # inference graphs, on the first no_grad call): the session's Program gains it.
    compiled_later: Callable[[str, torch.fx.GraphModule], None] | None = None
    # The world zeroc.world plans (its ZeroLayout's ``planned``); None: a real run.
    planned: PlannedWorld | None = None
    # ``reduce_quant``: the model's error-feedback store and parameter names, for the ZeRO
    # lowering (``zeroc.runtime.quant.reduce.ResidualScope``); None: none kept per model.
    residuals: ResidualScope | None = None

    @property
    def timed(self) -> bool:
        """Whether the graphs' calls are kept for a plan's step estimate (a planned world)."""
        return self.planned is not None

    @property
    def path(self) -> str:
        """Which kernels run the graphs: ``"inductor"`` or zeroc's (``kernel_path``)."""
        return kernel_path(self.config.kernels, self.device)

    def _run(self, graph: torch.fx.GraphModule, kind: str, passes: tuple,
             extras: dict[str, Any]) -> tuple[torch.fx.GraphModule, PassContext, list[PassInfo]]:
        ctx = PassContext(config=self.config, graph_name=f"{self.name}.{kind}", kind=kind,
                          device=self.device, planned=self.planned, extras=extras)
        graph, records = run_passes(graph, ctx, passes, record=self.config.record_graphs)
        infos = pass_infos(records)
        self.record.passes.extend(infos)
        return graph, ctx, infos

    def joint(self, joint: torch.fx.GraphModule, keep_graph: bool) -> torch.fx.GraphModule:
        """The joint passes on the joint forward+backward graph; ``keep_graph``: the plan
        shows the joint graph (pp = 1's one joint graph per record)."""
        joint, _, _ = self._run(joint, "joint", JOINT_PASSES,
                                {"input_names": self.input_names})
        if keep_graph:
            name = f"{self.name}.joint"
            self.record.joint = graph_info(joint, name, "joint", graph_text(joint), self.timed)
        return joint

    def partition(self, joint: torch.fx.GraphModule, joint_inputs: Any, *,
                  num_fwd_outputs: int, **kwargs: Any
                  ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        """Forward and backward graphs of ``joint`` by ``config.partitioner``.

        With hpZ pieces in ``joint`` (``secondary_shard``), a first partition tells which
        weights the backward re-gathers; the pieces of the others are dropped
        (``keep_read_secondary_shards``) before the partition that is kept."""
        self.num_fwd_outputs = num_fwd_outputs
        if joint.graph.find_nodes(op="call_function", target=SECONDARY_SHARD):
            _, trial = self._partition(joint, joint_inputs, num_fwd_outputs, dict(kwargs))
            joint, _, _ = self._run(joint, "joint", (keep_read_secondary_shards,),
                                    {"backward": trial, "input_names": self.input_names})
            if self.record.joint is not None and self.record.joint.name == f"{self.name}.joint":
                self.record.joint = graph_info(joint, self.record.joint.name, "joint",
                                               graph_text(joint), self.timed)
        return self._partition(joint, joint_inputs, num_fwd_outputs, kwargs)

    def _partition(self, joint: torch.fx.GraphModule, joint_inputs: Any,
                   num_fwd_outputs: int, kwargs: dict[str, Any]
                   ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        if self.config.partitioner == "min_cut":
            return min_cut_rematerialization_partition(
                joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        kwargs.pop("compiler", None)
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                 **kwargs)

    def graph(self, graph: torch.fx.GraphModule, kind: str
              ) -> tuple[torch.fx.GraphModule, list[PassInfo]]:
        """The graph passes on one functional graph (``kind``: forward, backward or
        inference), the cross-rank check and the records; returns the graph and the passes'
        records."""
        group = self.zero_group
        if group is None:
            zero, group = zero_markers(graph)
            if group:
                self.record.zero = (self.zero_stage_hint if self.zero_stage_hint is not None
                                    else max(self.record.zero, zero))
                self.record.zero_group = group
        graph, ctx, infos = self._run(graph, kind, graph_passes(self.path),
                                      {"input_names": self.input_names, "zero_group": group,
                                       "residuals": self.residuals})
        name = f"{self.name}.{kind}"
        text = graph_text(graph)
        # The data-parallel ranks compiled it alike, or all of them raise. A planned world's
        # one program stands for every rank: there is nothing to compare. At pp = 1 (no
        # group given: the graph's own collectives name it) the graph's collectives are
        # compared; a pipeline stage graph, which issues none, is compared whole.
        if self.planned is None:
            compared = collective_text(graph) if self.zero_group is None else text
            check_same_graph(name, comparable_text(compared), group, self.device)
        self.record.graphs.append(graph_info(graph, name, kind, text, self.timed))
        self.record.kernels.extend(ctx.kernels)
        self.record.collectives.extend(ctx.collectives)
        if kind == "forward":
            self.record.saved_bytes += saved_bytes(graph, self.num_fwd_outputs)
        return graph, infos

    def compiles_kernels(self) -> bool:
        """Whether this compiler's graphs run as Inductor code (not while planning on fakes)."""
        return self.path == "inductor" and (self.planned is None or not self.planned.simulated)

    def kernels(self, graph: torch.fx.GraphModule, name: str,
                inputs: list[Any] | None = None) -> Callable[..., Any] | None:
        """``graph`` compiled by Inductor, now from ``inputs`` (a boxed callable) or, without
        them, on its first call (``LazyInductorGraph``); ``None`` where the FX graph runs."""
        if not self.compiles_kernels():
            return None
        if inputs is None:
            return LazyInductorGraph(graph, name, self.record, self.config.kernel_autotune)
        compiled = InductorGraph(graph, name, list(inputs), self.config.kernel_autotune)
        _record_inductor(self.record, compiled, name)
        return compiled.run_boxed

    def inference_now(self, graph: torch.fx.GraphModule) -> Callable[..., Any]:
        """The inference graph's passes and, when Inductor runs it, its kernels compiled from
        its placeholders' example values (for graphs compiled on their first call)."""
        graph, _ = self.graph(graph, "inference")
        name = f"{self.name}.inference"
        if self.compiled_later is not None:
            self.compiled_later(name, graph)
        if not self.compiles_kernels():
            return graph
        compiled = InductorGraph(graph, name, autotune=self.config.kernel_autotune)
        _record_inductor(self.record, compiled, name)
        return compiled


def saved_bytes(forward: torch.fx.GraphModule, num_fwd_outputs: int) -> int:
    """Bytes the forward saves for the backward (its outputs after the user-visible ones)."""
    output = next(n for n in reversed(forward.graph.nodes) if n.op == "output")
    saved = output.args[0][num_fwd_outputs:]
    return sum(tensor_bytes(n.meta.get("val")) for n in saved if isinstance(n, torch.fx.Node))
