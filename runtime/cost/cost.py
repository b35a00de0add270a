"""Cost model v0: FLOPs and bytes moved for every node of a graph, from fake tensors.

FLOPs of matmuls, convolutions and attention come from ``torch.utils.flop_counter``'s formula
registry (the same numbers ``FlopCounterMode`` reports). Every other op that produces a tensor
is counted as one FLOP per output element for pointwise work, or one per input element for
reductions. Bytes are the bytes read (tensor inputs) plus written (tensor outputs); views and
other aliasing ops move no bytes; a collective counts the bytes it sends over the network
(``zeroc.runtime.collectives.collective_bytes``) and no FLOPs. Peak memory is a liveness
walk over the graph: inputs stay live for the whole graph, every other value is freed after
its last use.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx
from torch.utils.flop_counter import flop_registry

from zeroc.runtime.collectives import ISSUE_OPS, WAIT_OP, collective_bytes
from zeroc.runtime.cost.op_timing import encode_call
from zeroc.runtime.plan.records import GraphInfo, NodeCost
from zeroc.runtime.torch_compat import OpOverload, tree_flatten

# Adam and AdamW keep two state tensors (exp_avg, exp_avg_sq) per parameter.
ADAM_STATES = 2

aten = torch.ops.aten

# Ops that return a view of (or share storage with) an input: no bytes move.
_ALIAS_PACKETS = {
    aten.view, aten._unsafe_view, aten.reshape, aten.expand, aten.permute, aten.t,
    aten.transpose, aten.squeeze, aten.unsqueeze, aten.slice, aten.select, aten.alias,
    aten.as_strided, aten.detach, aten.split, aten.split_with_sizes, aten.unbind,
    aten.view_as_real, aten.view_as_complex, aten.unfold, aten.diagonal, aten.lift_fresh,
}
_REDUCTION_PACKETS = {
    aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.var, aten.var_mean,
    aten.std, aten.prod, aten.argmax, aten.argmin, aten.logsumexp, aten.norm,
    aten._log_softmax, aten._softmax, aten.native_layer_norm, aten.native_layer_norm_backward,
    aten._softmax_backward_data, aten._log_softmax_backward_data, aten.nll_loss_forward,
    aten.nll_loss_backward,
}


def concrete(value: Any) -> int:
    """An int for a size that may be symbolic (dynamic shapes): its hint, without adding a
    guard (``int()`` on a SymInt would specialize the compiled graph to this one size)."""
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        hint = value.node.hint
        return int(hint) if hint is not None else 0
    return int(value)


def _numel(t: torch.Tensor) -> int:
    return concrete(t.numel())


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in ``value`` (a tensor, or a nested tuple/list of them)."""
    return sum(_numel(t) * t.element_size() for t in _tensors(value))


def _node_value(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg


def _packet(target: Any) -> Any:
    return getattr(target, "overloadpacket", None)


def is_alias(target: Any) -> bool:
    """Whether ``target`` (an aten op) returns a view of an input: it moves no bytes."""
    return _packet(target) in _ALIAS_PACKETS


def is_pointwise(target: Any) -> bool:
    """Whether ``target`` is an elementwise aten op (torch's ``pointwise`` tag): what a
    compiled graph fuses, and what a recomputing partitioner recomputes."""
    return torch.Tag.pointwise in getattr(target, "tags", ())


def call_cost(target: Any, args: Any, kwargs: Any, out: Any) -> tuple[int, int]:
    """``(FLOPs, bytes)`` of one call of ``target`` on (fake) ``args`` and ``kwargs`` that gave
    ``out`` (see the module docstring)."""
    packet = _packet(target)
    if packet in _ALIAS_PACKETS:
        return 0, 0
    in_tensors = _tensors((args, kwargs))
    read = sum(_numel(t) * t.element_size() for t in in_tensors)
    written = tensor_bytes(out)
    collective = ISSUE_OPS.get(target)
    if collective is not None:
        return 0, collective_bytes(collective, read, written)
    if target is WAIT_OP:
        return 0, 0
    flops = 0
    formula = flop_registry.get(packet)
    if formula is not None:
        try:
            flops = concrete(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not accept these args: fall back below
            formula = None
    if formula is None:
        counter = getattr(target, "zeroc_flops", None)
        if counter is not None:
            flops = concrete(counter(in_tensors, _tensors(out)))
        elif packet in _REDUCTION_PACKETS:
            flops = sum(_numel(t) for t in in_tensors)
        else:
            flops = sum(_numel(t) for t in _tensors(out))
    return flops, read + written


def node_cost(node: torch.fx.Node, timed: bool = False) -> NodeCost:
    """FLOPs and bytes of one ``call_function`` node (zero for anything else). ``timed``: a
    planned world's graph, whose calls a plan's step estimate times: the call is encoded."""
    name, target = node.name, _target_name(node)
    if node.op != "call_function" or node.target is operator.getitem:
        return NodeCost(name, target, 0, 0)
    args = torch.fx.node.map_arg(node.args, _node_value)
    kwargs = torch.fx.node.map_arg(node.kwargs, _node_value)
    # Only a plan's step estimate times calls (zeroc.runtime.cost.op_timing); a training compile
    # keeps none.
    # a collective or its wait is not timed as an op either.
    timed = timed and node.target not in ISSUE_OPS and (
        node.target is not WAIT_OP)
    call = encode_call(node.target, args, kwargs) if timed else ""
    if is_alias(node.target):
        return NodeCost(name, target, 0, 0, call)
    flops, moved = call_cost(node.target, args, kwargs, node.meta.get("val"))
    return NodeCost(name, target, flops, moved, call)


def _target_name(node: torch.fx.Node) -> str:
    if node.op != "call_function":
        return node.op
    target = node.target
    name = getattr(target, "zeroc_name", None) or getattr(target, "__name__", None)
    if isinstance(target, OpOverload):
        return str(target)
    return name or type(target).__name__


def peak_bytes(gm: torch.fx.GraphModule, include_inputs: bool = True) -> int:
    """Peak bytes live while the graph runs, freeing each value after its last use.

    With ``include_inputs`` the graph's inputs (live throughout) are added; without, only the
    values the graph itself allocates are counted.
    """
    nodes = list(gm.graph.nodes)
    last_use: dict[torch.fx.Node, int] = {}
    for index, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            last_use[arg] = index
    live = 0
    peak = 0
    inputs = 0
    for index, node in enumerate(nodes):
        if node.op == "placeholder":
            inputs += tensor_bytes(node.meta.get("val"))
            continue
        if node.op == "output":
            continue
        if _packet(node.target) not in _ALIAS_PACKETS and node.target is not operator.getitem:
            live += tensor_bytes(node.meta.get("val"))
        peak = max(peak, live)
        for arg in node.all_input_nodes:
            if last_use.get(arg) == index and arg.op != "placeholder":
                if _packet(arg.target) not in _ALIAS_PACKETS and arg.target is not operator.getitem:
                    live -= tensor_bytes(arg.meta.get("val"))
        if node not in last_use:  # dead value, freed at once (outputs are used by "output")
            if _packet(node.target) not in _ALIAS_PACKETS and node.target is not operator.getitem:
                live -= tensor_bytes(node.meta.get("val"))
    return inputs + peak if include_inputs else peak


def graph_info(gm: torch.fx.GraphModule, name: str, kind: str, code: str = "",
               timed: bool = False) -> GraphInfo:
    """Summarize a graph: node count, inputs/outputs, FLOPs, bytes, peak bytes, per-node costs.
    ``timed``: planned for a world (``PlannedWorld``), its node costs keep their calls."""
    costs = tuple(node_cost(n, timed) for n in gm.graph.nodes if n.op == "call_function")
    outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return GraphInfo(
        name=name,
        kind=kind,
        nodes=sum(1 for n in gm.graph.nodes if n.op == "call_function"),
        inputs=sum(1 for n in gm.graph.nodes if n.op == "placeholder"),
        outputs=len(_flat_outputs(outputs.args[0])),
        flops=sum(c.flops for c in costs),
        bytes=sum(c.bytes for c in costs),
        peak_bytes=peak_bytes(gm),
        node_costs=costs,
        code=code,
    )


def _flat_outputs(value: Any) -> list[Any]:
    leaves, _ = tree_flatten(value)
    return leaves


def total(costs: Iterable[NodeCost]) -> tuple[int, int]:
    """Summed (FLOPs, bytes) of ``costs``."""
    flops = moved = 0
    for cost in costs:
        flops += cost.flops
        moved += cost.bytes
    return flops, moved
