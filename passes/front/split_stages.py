"""Cut a (micro-batch) Dynamo graph into pipeline stages at module boundaries.

Units. Every node that depends on a batch input belongs to a unit: the repeated block it was
traced in, found at any depth (``layers.3``, ``transformer.h.3``, ``m.model.layers.3``: see
``zeroc.passes.front.stage_units``), or outside the blocks the module it was traced in
(``tok_emb``, ``m.model.embed_tokens``, ``lm_head``). Stages are cut only in front of blocks,
so every stage holds at least one block: the units before the first block join the first
stage, those after the last block the last stage.
Nodes traced outside any module that read a module's output (the loss, an embedding sum)
run in the latest stage of their inputs.

Balance (``zeroc.passes.front.stage_balance``). A unit costs its estimated time: FLOPs plus bytes
moved times ``FLOPS_PER_BYTE`` (so a memory-bound embedding weighs what it really costs, not
zero). The cut points minimise the most expensive stage (a linear-partition dynamic
program). The user can pin them: ``split_points=["model.layers.4", ...]`` names, by its full
dotted name, the block that starts stage 1, 2, ...

Stage graphs. Values that read only placeholders (``zeroc.unshard`` gathers, rotary tables,
positions, ``targets.view(-1)``) are recomputed in every stage that uses them, so they never
travel: every rank of a pipeline has the whole batch.
A batch-dependent value produced in stage ``s`` and used in stage ``t > s`` travels through
every stage in between: ``messages[s]`` lists what stage ``s`` sends to ``s + 1``. Stage ``k``'s
graph takes ``(parameters..., local inputs..., received values...)`` - its parameters and local
inputs in the Dynamo graph's placeholder order - and returns ``(values it produces that later
stages need..., model outputs...)``, the model outputs only on the last stage.

Grad mode. A ``with torch.no_grad():`` region is two ``torch._C._set_grad_enabled`` calls in
the Dynamo graph that nothing reads; the nodes between them are computed without gradient.
Each stage graph re-emits the switches around the nodes it copies, so a value recomputed in
another stage, or a region cut by a stage boundary, keeps the grad mode it was traced in
(without them a parameter read only under ``no_grad`` would get a gradient eager never gives).

The pass. ``split_stages(gm, ctx)`` (``run_passes``, with a
``zeroc.passes.front.context.FrontContext``) cuts ``ctx.mgraph``, whose graph ``gm`` is, into
``ctx.num_stages`` stages (``cut_stages``) and publishes the ``StageSplit`` as ``ctx.split``.
The graph it returns is ``gm`` as the stages call one another, what
``torch.fx.passes.split_module`` makes: the same inputs, one ``call_module`` of submodule
``stage<k>`` (stage ``k``'s graph) per stage, each value taken from the stage that made it,
and the last stage's outputs returned. Its text shows the cut.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from zeroc.passes.base import PassContext, PassResult, graph_module
from zeroc.passes.front.context import PassOrderError, front_context, published
from zeroc.passes.front.microbatch_shapes import MicrobatchGraph
from zeroc.passes.front.stage_balance import FLOPS_PER_BYTE, assign_stages
from zeroc.runtime.torch_compat import SET_GRAD_ENABLED, tree_flatten

__all__ = ["FLOPS_PER_BYTE", "StageSpec", "StageSplit", "cut_stages", "split_stages"]



@dataclasses.dataclass(frozen=True)
class StageSpec:
    """One stage: its graph and how its inputs and outputs map to the model and messages."""

    index: int
    units: tuple[str, ...]
    gm: torch.fx.GraphModule
    param_inputs: tuple[int, ...]
    local_inputs: tuple[int, ...]
    in_keys: tuple[str, ...]
    out_keys: tuple[str, ...]
    num_model_outputs: int
    output_requires_grad: tuple[bool, ...]
    flops: int
    bytes: int
    activation_bytes: int


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """The stages, the messages between neighbours and the meta of every travelling value.

    ``values[key] = (shape, dtype, requires_grad)`` at the micro-batch size.
    """

    stages: tuple[StageSpec, ...]
    messages: tuple[tuple[str, ...], ...]
    values: dict[str, tuple[tuple[int, ...], torch.dtype, bool]]
    unit_costs: tuple[tuple[str, float], ...]


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def split_stages(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Pass: ``cut_stages`` of ``ctx.mgraph`` (whose graph ``gm`` is) into ``ctx.num_stages``
    stages at the config's ``split_points``; publishes ``ctx.split`` and returns ``gm`` as its
    stages call one another (a new graph, see the module docstring)."""
    front = front_context(ctx, "split_stages")
    mgraph = published(front.mgraph, "ctx.mgraph", "microbatch_graph")
    if mgraph.gm is not gm:  # stage graphs are cut from the values the micro-batch run saw
        raise PassOrderError("zeroc: split_stages cuts the graph microbatch_graph made; a "
                             "pass between them replaced it")
    front.split = split = cut_stages(mgraph, front.num_stages, front.params,
                                     ctx.config.split_points)
    return PassResult(_stage_calls(gm, split), True, {
        "stages": len(split.stages), "messages": sum(len(m) for m in split.messages),
        "units": " | ".join(",".join(s.units) for s in split.stages)})


def _stage_calls(gm: torch.fx.GraphModule, split: StageSplit) -> torch.fx.GraphModule:
    """``gm`` as its stages call one another: ``gm``'s placeholders, one ``stage<k>`` call per
    stage (its parameters, its local inputs, what it receives), each value a stage sends
    taken out of its call by ``getitem`` under the value's name, and ``gm``'s outputs read
    from the last stage's call."""
    graph = torch.fx.Graph()
    root = torch.nn.Module()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        env[node] = graph.node_copy(node, lambda n: env[n])
    sent: dict[str, torch.fx.Node] = {}
    call = None
    for spec in split.stages:
        name = f"stage{spec.index}"
        root.add_module(name, spec.gm)
        args = [env[placeholders[i]] for i in (*spec.param_inputs, *spec.local_inputs)]
        call = graph.call_module(name, (*args, *(sent[key] for key in spec.in_keys)))
        for j, key in enumerate(spec.out_keys):
            sent[key] = graph.create_node("call_function", operator.getitem, (call, j),
                                          name=key)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    results = [a for a in tree_flatten(output.args[0])[0] if isinstance(a, torch.fx.Node)]
    returned: dict[torch.fx.Node, torch.fx.Node] = {}
    for j, result in enumerate(results):  # the last stage returns the model's outputs last
        returned.setdefault(result, graph.call_function(
            operator.getitem, (call, len(split.stages[-1].out_keys) + j)))
    graph.output(torch.fx.node.map_arg(output.args[0], lambda n: returned[n]))
    return graph_module(root, graph, "StageCalls")


def cut_stages(
    mgraph: MicrobatchGraph,
    num_stages: int,
    param_inputs: set[int],
    split_points: Sequence[str] | None = None,
) -> StageSplit:
    """Cut ``mgraph`` into ``num_stages`` stage graphs (see the module docstring).

    ``param_inputs`` are the placeholder indices that hold parameters; every other placeholder
    is a local input (a batch input sliced per micro-batch, or a buffer used whole).
    """
    gm = mgraph.gm
    stage, members, unit_costs = assign_stages(mgraph, num_stages, split_points)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index_of = {n.name: i for i, n in enumerate(placeholders)}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    results = [a for a in tree_flatten(output.args[0])[0] if isinstance(a, torch.fx.Node)]
    last = num_stages - 1
    for result in results:
        if stage.get(result.name, last) != last:
            raise ValueError(f"zeroc pipeline: model output {result.name} is computed before "
                             "the last stage; the model must return what its last layer makes")
    consumers: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        if node.name in stage:
            for arg in node.all_input_nodes:
                consumers.setdefault(arg.name, set()).add(stage[node.name])
    messages = []
    order = [n.name for n in gm.graph.nodes if n.name in stage]
    for s in range(num_stages - 1):
        messages.append(tuple(k for k in order
                              if stage[k] <= s and any(t > s for t in consumers.get(k, ()))))
    values = {}
    for key in {k for m in messages for k in m}:
        fake = mgraph.values[key]
        values[key] = (tuple(int(x) for x in fake.shape), fake.dtype, bool(fake.requires_grad))
    specs = []
    for k in range(num_stages):
        out_keys = messages[k] if k < last else ()
        out_keys = tuple(key for key in out_keys if stage[key] == k)
        specs.append(_stage_graph(mgraph, k, stage, members[k], index_of, param_inputs,
                                  out_keys, results if k == last else []))
    return StageSplit(stages=tuple(specs), messages=tuple(messages), values=values,
                      unit_costs=tuple(unit_costs))


def _mutators(gm: torch.fx.GraphModule) -> dict[str, list[torch.fx.Node]]:
    """Nodes that write into their first argument in place, by the name of that argument:
    ``x[i] = v`` (``operator.setitem``) and in-place methods (``x.masked_fill_(...)``)."""
    writers: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        target = node.target
        in_place = target is operator.setitem or (
            node.op == "call_method" and isinstance(target, str) and target.endswith("_")
            and not target.endswith("__"))
        if in_place and node.args and isinstance(node.args[0], torch.fx.Node):
            writers.setdefault(node.args[0].name, []).append(node)
    return writers


def _grad_modes(gm: torch.fx.GraphModule) -> dict[str, bool]:
    """The grad mode each node of ``gm`` was traced in (the graph starts with gradients on)."""
    modes: dict[str, bool] = {}
    enabled = True
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is SET_GRAD_ENABLED:
            enabled = bool(node.args[0])
        modes[node.name] = enabled
    return modes


def _storage(value: Any) -> Any:
    try:
        return StorageWeakRef(value.untyped_storage())
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


def _unaliased(graph: torch.fx.Graph, copied: torch.fx.Node, values: dict[str, Any],
               node: torch.fx.Node, inputs: list[torch.fx.Node],
               earlier: list[torch.fx.Node]) -> torch.fx.Node:
    """``copied``, or a clone of it when the output is a view or shares memory with a stage
    input or an earlier output (a mask passed on as a view of an input, hidden states
    reshaped): AOTAutograd's joint export takes no aliased outputs, and a message must own
    its memory while it is in flight."""
    value = values.get(node.name)
    mine = _storage(value)
    others = [_storage(values.get(n.name)) for n in (*inputs, *earlier)]
    is_view = isinstance(value, torch.Tensor) and value._is_view()
    if mine is None or (mine not in others and not is_view):
        return copied
    clone = graph.call_function(torch.clone, (copied,))
    clone.meta = dict(copied.meta)
    return clone


def _stage_graph(
    mgraph: MicrobatchGraph,
    k: int,
    stage: dict[str, int],
    units: tuple[str, ...],
    index_of: dict[str, int],
    param_inputs: set[int],
    out_keys: tuple[str, ...],
    results: list[torch.fx.Node],
) -> StageSpec:
    gm = mgraph.gm
    own = [n for n in gm.graph.nodes if stage.get(n.name) == k]
    needed: set[str] = set()
    received: list[torch.fx.Node] = []
    work = list(own)
    mutators = _mutators(gm)
    while work:
        node = work.pop()
        for arg in node.all_input_nodes:
            if arg.name in needed:
                continue
            if arg.name in stage and stage[arg.name] != k:
                if arg not in received:
                    received.append(arg)
                continue
            needed.add(arg.name)
            if arg.op != "placeholder" and arg.name not in stage:
                work.append(arg)
                # A value recomputed here is recomputed with the writes into it, which
                # nothing reads (``shifted[..., 1:] = labels[..., :-1]``).
                for writer in mutators.get(arg.name, ()):
                    if writer.name not in needed and writer.name not in stage:
                        needed.add(writer.name)
                        work.append(writer)
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    received.sort(key=lambda n: order[n.name])
    inputs = sorted(index_of[name] for name in needed if name in index_of)
    params = tuple(i for i in inputs if i in param_inputs)
    locals_ = tuple(i for i in inputs if i not in param_inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i in (*params, *locals_):
        env[placeholders[i]] = graph.node_copy(placeholders[i], lambda n: env[n])
    for node in received:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    flops = moved = activation = 0
    modes, enabled = _grad_modes(gm), True
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or node in env:
            continue
        if node.op == "call_function" and node.target is SET_GRAD_ENABLED:
            continue  # re-emitted below where the copied nodes need a switch
        if stage.get(node.name) == k or (node.name in needed and node.name not in stage):
            if modes[node.name] != enabled:
                enabled = modes[node.name]
                graph.call_function(SET_GRAD_ENABLED, (enabled,))
            env[node] = graph.node_copy(node, lambda n: env[n])
            estimate = mgraph.costs.get(node.name)
            if estimate is not None:
                flops += estimate.flops
                moved += estimate.bytes
            if node.name in mgraph.batch_dependent:
                activation += _nbytes(mgraph.values.get(node.name))
    if not enabled:
        graph.call_function(SET_GRAD_ENABLED, (True,))
    by_name = {n.name: n for n in gm.graph.nodes}
    outputs = [by_name[key] for key in out_keys] + list(results)
    stage_inputs = [placeholders[i] for i in (*params, *locals_)] + received
    graph.output(tuple(_unaliased(graph, env[n], mgraph.values, n, stage_inputs, outputs[:j])
                       for j, n in enumerate(outputs)))
    stage_gm = torch.fx.GraphModule(gm, graph)
    requires_grad = tuple(bool(getattr(mgraph.values.get(n.name), "requires_grad", False))
                          for n in outputs)
    return StageSpec(
        index=k, units=units, gm=stage_gm, param_inputs=params, local_inputs=locals_,
        in_keys=tuple(n.name for n in received), out_keys=out_keys,
        num_model_outputs=len(results), output_requires_grad=requires_grad, flops=flops,
        bytes=moved, activation_bytes=activation,
    )
