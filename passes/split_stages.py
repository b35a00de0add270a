"""Cut a (micro-batch) Dynamo graph into pipeline stages at module boundaries.

Units. Every node that depends on a batch input belongs to a unit: the repeated block it was
traced in, found at any depth (``layers.3``, ``transformer.h.3``, ``m.model.layers.3``: see
``zeroc.passes.stage_units``), or outside the blocks the module it was traced in
(``tok_emb``, ``m.model.embed_tokens``, ``lm_head``). Stages are cut only in front of blocks,
so every stage holds at least one block: the units before the first block join the first
stage, those after the last block the last stage.
Nodes traced outside any module that read a module's output (the loss, an embedding sum)
run in the latest stage of their inputs.

Balance. A unit costs its estimated time: FLOPs plus bytes moved times
``FLOPS_PER_BYTE`` (so a memory-bound embedding weighs what it really costs, not zero). The
cut points minimise the most expensive stage (a linear-partition dynamic program). The user
can pin them: ``split_points=["model.layers.4", ...]`` names, by its full dotted name, the
block that starts stage 1, 2, ...

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
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from zeroc.passes.microbatch_shapes import MicrobatchGraph
from zeroc.passes.stage_units import find_blocks
from zeroc.runtime.torch_compat import SET_GRAD_ENABLED, tree_flatten

# A nominal machine balance: one byte moved costs about as much time as this many FLOPs.
FLOPS_PER_BYTE = 10


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


def _partition(costs: Sequence[float], parts: int) -> list[int]:
    """Start indices of ``parts`` contiguous groups of ``costs`` minimising the largest sum."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def _node_cost(mgraph: MicrobatchGraph, name: str) -> float:
    estimate = mgraph.costs.get(name)
    return 0.0 if estimate is None else estimate.flops + FLOPS_PER_BYTE * estimate.bytes


def assign_stages(
    mgraph: MicrobatchGraph, num_stages: int, split_points: Sequence[str] | None = None
) -> tuple[dict[str, int], list[tuple[str, ...]], list[tuple[str, float]]]:
    """Stage of every batch-dependent node, the units of each stage, and each unit's cost."""
    # Anchored: traced in a module, or fed by such a node. Everything else reads only
    # placeholders (batch inputs, parameters, buffers) and is recomputed where it is used.
    layout = find_blocks([n for n in mgraph.gm.graph.nodes if n.name in mgraph.batch_dependent],
                         lambda n: _node_cost(mgraph, n.name))
    unit_of = layout.unit_of
    anchored: set[str] = set()
    for node in mgraph.gm.graph.nodes:
        if node.op in ("placeholder", "output") or node.name not in mgraph.batch_dependent:
            continue
        if unit_of(node) is not None or any(a.name in anchored for a in node.all_input_nodes):
            anchored.add(node.name)
    nodes = [n for n in mgraph.gm.graph.nodes if n.name in anchored]
    units: list[str] = []
    position: dict[str, int] = {}
    for node in nodes:
        unit = unit_of(node)
        if unit is not None:
            if unit not in units:
                units.append(unit)
            position[node.name] = units.index(unit)
        else:
            position[node.name] = max((position.get(a.name, 0) for a in node.all_input_nodes),
                                      default=0)
    unit_cost = [0.0] * len(units)
    for node in nodes:
        if units:
            unit_cost[position[node.name]] += _node_cost(mgraph, node.name)
    blocks = [i for i, u in enumerate(units) if layout.is_block(u)] or list(range(len(units)))
    if len(blocks) < num_stages:
        raise ValueError(
            f"zeroc pipeline: the model has {len(blocks)} layers "
            f"({', '.join(units[i] for i in blocks) or 'none'}) but {num_stages} pipeline stages "
            f"were asked for; every stage needs at least one layer: use at most {len(blocks)} "
            "stages or a deeper model"
        )
    if split_points is not None:
        starts = _pinned_starts(units, [units[i] for i in blocks], split_points, num_stages)
    else:
        # Segment i: block i plus the units up to the next block (and, for the first, before).
        segment = [0.0] * len(blocks)
        for u in range(len(units)):
            owner = max([i for i, b in enumerate(blocks) if b <= u], default=0)
            segment[owner] += unit_cost[u]
        starts = [0] + [blocks[i] for i in _partition(segment, num_stages)[1:]]
    stage_of_unit = [sum(1 for s in starts[1:] if s <= u) for u in range(len(units))]
    stage: dict[str, int] = {}
    for node in nodes:
        own = stage_of_unit[position[node.name]] if units else 0
        inputs = [stage[a.name] for a in node.all_input_nodes if a.name in stage]
        stage[node.name] = max([own, *inputs])
    members = [tuple(u for u, s in zip(units, stage_of_unit, strict=True) if s == k)
               for k in range(num_stages)]
    return stage, members, list(zip(units, unit_cost, strict=True))


def _pinned_starts(units: list[str], blocks: list[str], split_points: Sequence[str],
                   num_stages: int) -> list[int]:
    if len(split_points) != num_stages - 1:
        raise ValueError(
            f"zeroc pipeline: split_points={list(split_points)!r} names {len(split_points)} cut "
            f"points; {num_stages} stages need {num_stages - 1} (the first unit of stages 1.."
            f"{num_stages - 1})"
        )
    starts = [0]
    for name in split_points:
        if name not in blocks:
            raise ValueError(
                f"zeroc pipeline: split point {name!r} is not one of the model's blocks; give "
                f"the full dotted name of a block that starts a stage: {_shorten(blocks)}"
            )
        if units.index(name) <= starts[-1]:
            raise ValueError(
                f"zeroc pipeline: split_points={list(split_points)!r} must name modules in "
                "forward order, each after the previous one and after the first module"
            )
        starts.append(units.index(name))
    return starts


def _shorten(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} blocks)" if len(names) > limit else "")


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def split_stages(
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
