"""Capture: one Dynamo graph -> AOTAutograd joint graph -> forward/backward graphs -> passes.

``compile_dynamo_graph`` is called once per Dynamo graph (a model with graph breaks gives
several; a recompile on new shapes gives another). AOTAutograd traces the joint
forward+backward graph with our decompositions, our partition function splits it into
functional forward and backward graphs (recording the joint graph for the plan), and each of
those runs through the literal pass pipeline before the runtime executes it. AOTAutograd's
runtime wrapper keeps eager semantics: input mutations (BatchNorm running stats) are applied
after the graph, ``torch.no_grad()`` takes the inference graph, and autograd calls the backward.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from zeroc.codegen.inductor_graphs import inductor_decompositions
from zeroc.frontend.config import Config
from zeroc.frontend.grad_coverage import check_covered, differentiated_inputs
from zeroc.frontend.log_setup import CompileProgress, decisions
from zeroc.frontend.session import CompiledGraph, CompileSession
from zeroc.frontend.stage_compiler import StageCompiler
from zeroc.passes.base import PassContext, count_nodes, pass_infos, run_passes
from zeroc.passes.decompositions import decomposition_table
from zeroc.passes.pipeline import DYNAMO_PASSES
from zeroc.runtime.cost.cost import peak_bytes
from zeroc.runtime.executor import GraphExecutor
from zeroc.runtime.plan.records import ParamInfo
from zeroc.runtime.program import Program, StageProgram, frozen_mapping
from zeroc.runtime.torch_compat import (
    aot_autograd,
)
from zeroc.sharding.residual_state import residual_scope

SOURCE_NAME_META = "zeroc_source_name"

log = logging.getLogger(__name__)


def source_name(placeholder: torch.fx.Node) -> str:
    """A readable name for a Dynamo placeholder: ``layers.0.attn.weight`` or ``x``."""
    if SOURCE_NAME_META in placeholder.meta:  # kept when Dynamo's grapharg is gone
        return placeholder.meta[SOURCE_NAME_META]
    grapharg = placeholder.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return placeholder.name
    text = source.name() if callable(source.name) else str(source.name)
    # A zeroc-parallelized parameter is read from its flat buffer, ``module.__dict__[
    # '_zeroc_flat_<name>']`` (torch 2.13) or ``module._zeroc_flat_<name>`` (torch 2.11): it
    # reads as the parameter's name.
    parts = [a or b for a, b in re.findall(
        r"\.(?:_modules|_parameters|_buffers|__dict__)\['(?:_zeroc_flat_)?([^']+)'\]"
        r"|\._zeroc_flat_(\w+)", text)]
    if parts:
        return ".".join(parts)
    match = re.fullmatch(r"L\['([^']+)'\]", text)
    return match.group(1) if match else text


def parameter_infos(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> tuple[ParamInfo, ...]:
    """The parameters among the Dynamo graph's inputs, in input order."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    infos = []
    for node, value in zip(placeholders, example_inputs, strict=False):
        if isinstance(value, torch.nn.Parameter):
            infos.append(ParamInfo(
                name=source_name(node),
                shape=tuple(int(s) for s in value.shape),
                dtype=str(value.dtype).replace("torch.", ""),
                numel=value.numel(),
                bytes=value.numel() * value.element_size(),
            ))
    return tuple(infos)


def _graph_device(example_inputs: list[Any]) -> torch.device:
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def run_dynamo_passes(gm: torch.fx.GraphModule, config: Config, record: CompiledGraph,
                      device: torch.device, **extras: Any) -> torch.fx.GraphModule:
    """Run ``DYNAMO_PASSES`` on a Dynamo graph, recording them as ``<prefix>.dynamo``."""
    ctx = PassContext(config=config, graph_name=f"{record.prefix}.dynamo", kind="dynamo",
                      device=device, extras=extras)
    gm, records = run_passes(gm, ctx, DYNAMO_PASSES, record=config.record_graphs)
    record.passes.extend(pass_infos(records))
    return gm


def compile_dynamo_graph(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    config: Config,
    session: CompileSession,
) -> Callable[..., Any]:
    """Compile one Dynamo graph; returns the callable Dynamo will run in its place."""
    prefix = f"g{session.next_graph_index()}"
    progress = CompileProgress(log, prefix)
    record = CompiledGraph(prefix=prefix, params=parameter_infos(gm, example_inputs))
    device = _graph_device(example_inputs)
    record.device = str(device)
    log.debug("zeroc: %s: a Dynamo graph of %d nodes on %s", prefix, len(gm.graph.nodes), device)
    input_names = _input_names(gm)
    # The model's ZeRO stage comes from its layout (the graph's markers name op stages).
    layout = next((v._zeroc_layout for v in example_inputs if hasattr(v, "_zeroc_layout")), None)
    session.add(record)
    # What eager's backward would reach, read before any zeroc pass can change the graph.
    expected, param_names = _trainable(gm, example_inputs)
    gm = run_dynamo_passes(gm, config, record, device)
    compiler = StageCompiler(config, record, prefix, device, input_names,
                             zero_stage_hint=layout.zero if layout is not None else None,
                             planned=layout.planned if layout is not None else None,
                             residuals=residual_scope(example_inputs, input_names)
                             if config.reduce_quant else None)

    def partition(joint: torch.fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                  **kwargs: Any) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        joint = compiler.joint(joint, keep_graph=True)
        _check_joint_gradients(joint, num_fwd_outputs, expected, param_names, prefix)
        return compiler.partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                  **kwargs)

    path = compiler.path

    def make_compiler(kind: str) -> Callable[[torch.fx.GraphModule, Any], Callable[..., Any]]:
        def compile_graph(graph: torch.fx.GraphModule, inputs: Any) -> Callable[..., Any]:
            name = f"{prefix}.{kind}"
            # The training forward compiles first, then its backward; inference alone.
            position = "graph 2 of 2" if kind == "backward" else (
                "graph 1 of 2" if kind == "forward" else "graph 1 of 1")
            if kind == "backward":  # compiled on the first backward: timed from here
                progress.lap()
            progress.step("the %s, %s", kind, position)
            graph, infos = compiler.graph(graph, kind)
            record.transient_bytes = max(record.transient_bytes,
                                         peak_bytes(graph, include_inputs=False))
            run_boxed = compiler.kernels(graph, name, list(inputs))
            if log.isEnabledFor(logging.INFO):
                # The forward's line also says what the Dynamo and joint passes decided.
                earlier = (f"{prefix}.dynamo", f"{prefix}.joint") if kind != "backward" else ()
                done = [p for p in record.passes if p.graph in earlier] + infos
                log.info("zeroc: %s compiled in %.2f s (%s, %s kernels): %d nodes; %s", name,
                         progress.lap(), position, path, count_nodes(graph),
                         decisions(done))
            _release_metadata(graph)
            executor = GraphExecutor(graph, name, run_boxed)
            session.set_program(_with_graph(session.programs.get(prefix), prefix, kind, graph,
                                            executor, layout))
            return executor

        return compile_graph

    backend = aot_autograd(
        fw_compiler=make_compiler("forward"),
        bw_compiler=make_compiler("backward"),
        inference_compiler=make_compiler("inference"),
        partition_fn=partition,
        decompositions=(inductor_decompositions() if path == "inductor"
                        else decomposition_table(path)),
    )
    return backend(gm, example_inputs)


def _trainable(gm: torch.fx.GraphModule,
               example_inputs: list[Any]) -> tuple[frozenset[int] | None, dict[int, str]]:
    """The trainable parameters eager's backward reaches (``zeroc.frontend.grad_coverage``), by
    placeholder index, and every trainable parameter's readable name."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = {i: source_name(n) for i, (n, v) in enumerate(zip(placeholders, example_inputs,
                                                                 strict=False))
             if isinstance(v, torch.nn.Parameter) and v.requires_grad}
    return differentiated_inputs(gm), names


def _check_joint_gradients(joint: torch.fx.GraphModule, num_fwd_outputs: int,
                           expected: frozenset[int] | None, names: dict[int, str],
                           prefix: str) -> None:
    """Every parameter eager's backward reaches has a gradient output in the joint graph
    (its outputs: the forward's, then one gradient or ``None`` per primal input)."""
    primals = sum(1 for n in joint.graph.nodes
                  if n.op == "placeholder" and n.name.startswith("primals"))
    output = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
    grads = list(output.args[0])[num_fwd_outputs:]
    if len(grads) != primals:  # inputs AOTAutograd merged or split: no position to read
        return
    produced = {i: grads[i] is not None for i in names}
    check_covered(expected, produced, names, {i: f"graph {prefix}" for i in names})


def _release_metadata(graph: torch.fx.GraphModule) -> None:
    """Drop the compile-time metadata of a graph that is only run from now on.

    The plan already holds what it needs (text, costs, records). Each node's ``meta`` keeps
    fake tensors, stack traces and source maps that would otherwise live as long as the
    compiled model (several MiB for a small transformer).
    """
    for node in graph.graph.nodes:
        node.meta = {}


def _with_graph(program: Program | None, prefix: str, kind: str, graph: torch.fx.GraphModule,
                executor: GraphExecutor, layout: Any) -> Program:
    """The pp = 1 Program of ``prefix`` with its ``kind`` graph compiled: a new frozen Program
    (one stage, whose schedule is autograd's: ``schedule=None``)."""
    if program is None:
        program = Program(name=prefix, graphs=frozen_mapping(),
                          stages=(StageProgram(index=0, forward=None, backward=None),),
                          zero=layout)
    stage = dataclasses.replace(program.stages[0], **{kind: executor})
    return program.with_graph(f"{prefix}.{kind}", graph, stage)


def _input_names(gm: torch.fx.GraphModule) -> dict[str, str]:
    """AOTAutograd names the i-th flat input ``primals_{i}``: map those to readable names."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {f"primals_{i + 1}": source_name(n) for i, n in enumerate(placeholders)}
