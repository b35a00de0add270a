"""Decomposition of composite aten ops, only where the pieces end up in fused kernels.

AOTAutograd traces the joint graph with *no* decompositions of these ops: ``native_layer_norm``,
``gelu``, ``_softmax`` and the rest stay whole, so a graph that is not fused (``fusion=False``,
``kernels`` running as aten, dynamic shapes, a dtype or layout the kernels do not take) runs
the same composite aten kernels as eager, one op where eager has one.

The fusion pass then decides per node:

* a composite op that has a lowering of its own (layer norm, softmax, log-softmax, gelu, silu
  and their backwards: see ``zeroc.codegen.aten_lowering``) is fused whole or left whole;
  it is never decomposed;
* a composite op without one (``native_layer_norm_backward``, ``mse_loss`` and its backward)
  is a *candidate* when its tensors have static shapes and fusible dtypes and the kernels are
  launched as Triton. :func:`decompose_where_fused` replaces every candidate by the graph its
  Python decomposition traces to (``make_fx`` on the node's fake values), groups the result,
  and keeps a candidate decomposed only when every piece that could be fused (a pointwise op
  or last-dimension reduction) landed in a fused kernel. The others are restored to their
  composite node and the grouping is redone, until no candidate changes (the set only
  shrinks, so this ends). Pieces a kernel cannot take at all (the column sums that give
  ``native_layer_norm_backward``'s weight and bias gradients) run as aten next to the kernel.

With ``kernels`` running as aten nothing is decomposed: the fused groups would run their aten
pieces one by one, slower than the composite kernel.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from zeroc.codegen.aten_lowering import op_kind
from zeroc.codegen.fusion_groups import FUSIBLE_DTYPES, Group, eligible
from zeroc.runtime.torch_compat import detect_fake_mode, get_decompositions

logger = logging.getLogger(__name__)

aten = torch.ops.aten

# Composite ops whose decomposition the fusion pass may use (those with a lowering of their
# own are fused whole instead, see the module docstring).
DECOMPOSED_OPS = (
    aten.native_layer_norm,
    aten.native_layer_norm_backward,
    aten._softmax,
    aten._softmax_backward_data,
    aten._log_softmax,
    aten._log_softmax_backward_data,
    aten.gelu,
    aten.gelu_backward,
    aten.silu,
    aten.silu_backward,
    aten.sigmoid_backward,
    aten.tanh_backward,
    aten.threshold_backward,
    aten.mse_loss,
    aten.mse_loss_backward,
)

FindGroups = Callable[[torch.fx.Graph], list[Group]]


def decomposition_table(kernel_backend: str = "triton") -> dict[Any, Any]:
    """The decompositions AOTAutograd traces with for zeroc's own kernels, ``kernel_backend``
    ``"triton"`` or ``"aten"`` (``zeroc.codegen.fused_kernel.choose_backend``): none, so
    composite ops reach the fusion pass whole and stay whole unless they fuse (module
    docstring). Raises ValueError for another backend (Inductor traces with its own table)."""
    if kernel_backend not in ("triton", "aten"):
        raise ValueError(f"decomposition_table: kernel_backend={kernel_backend!r}; allowed: "
                         "'triton', 'aten' (Inductor's graphs use inductor_decompositions)")
    return {}


def fusion_decompositions() -> dict[Any, Any]:
    """The Python decompositions of ``DECOMPOSED_OPS`` (op overload -> function) that the
    fusion pass may apply."""
    return get_decompositions(list(DECOMPOSED_OPS))


def _tensor_values(node: torch.fx.Node) -> list[Any]:
    val = node.meta.get("val")
    return list(val) if isinstance(val, (tuple, list)) else [val]


def is_candidate(node: torch.fx.Node, table: dict[Any, Any]) -> bool:
    """Whether the fusion pass may decompose ``node``: a composite op of ``table`` without a
    lowering of its own, whose tensors all have static shapes, fusible dtypes and one device."""
    if node.op != "call_function" or node.target not in table or op_kind(node.target):
        return False
    values = [v for v in _tensor_values(node) if v is not None]
    values += [a.meta.get("val") for a in node.all_input_nodes]
    if not values or not all(isinstance(v, torch.Tensor) for v in values):
        return False
    if len({v.device for v in values}) != 1:
        return False
    return all(v.dtype in FUSIBLE_DTYPES and all(isinstance(d, int) for d in v.shape)
               for v in values)


def trace_decomposition(node: torch.fx.Node, table: dict[Any, Any]) -> torch.fx.GraphModule:
    """The graph of ``node``'s decomposition, with one placeholder per input node (in
    ``node.all_input_nodes`` order), traced on the graph's fake values."""
    inputs = node.all_input_nodes
    values = [n.meta["val"] for n in inputs]

    def run(*tensors: torch.Tensor) -> Any:
        env = dict(zip(inputs, tensors, strict=True))
        args = torch.fx.node.map_arg(node.args, env.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
        return node.target(*args, **kwargs)

    fake_mode = detect_fake_mode(values)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        return make_fx(run, decomposition_table=table, tracing_mode="real")(*values)


def _inline(graph: torch.fx.Graph, node: torch.fx.Node,
            sub: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Replace ``node`` by a copy of ``sub``'s nodes; return the copied call_function nodes."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env: dict[torch.fx.Node, torch.fx.Node] = dict(
        zip(placeholders, node.all_input_nodes, strict=True))
    with graph.inserting_before(node):
        result = graph.graph_copy(sub.graph, env)
    if isinstance(node.meta.get("val"), (tuple, list)):
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise AssertionError(f"{node.name}: a multi-output node read by {user.name}")
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)
    return [env[n] for n in sub.graph.nodes if n.op == "call_function"]


def _copy_graph(graph: torch.fx.Graph) -> tuple[torch.fx.Graph, dict[torch.fx.Node, torch.fx.Node]]:
    """A copy of ``graph`` (node metadata shared shallowly) and the old -> new node map."""
    new = torch.fx.Graph(owning_module=graph.owning_module)
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    output = new.graph_copy(graph, env, return_output_node=True)
    new._codegen = copy.deepcopy(graph._codegen)
    value, old_output = output
    new_output = new.output(value, type_expr=getattr(old_output, "type", None))
    new_output.meta = copy.copy(old_output.meta)
    return new, env


def _fully_fused(pieces: list[torch.fx.Node], fused: set[torch.fx.Node]) -> bool:
    compute = [p for p in pieces
               if op_kind(p.target) in ("pointwise", "reduction") and eligible(p)]
    return bool(compute) and all(p in fused for p in compute)


def decompose_where_fused(gm: torch.fx.GraphModule, find: FindGroups,
                          backend: str) -> tuple[torch.fx.GraphModule, list[Group]]:
    """Decompose the candidate composite nodes of ``gm`` whose pieces all fuse; return the
    graph module (its graph replaced when something was decomposed) and the groups ``find``
    gives on it. ``backend`` is the kernels' path (``"triton"`` or ``"aten"``)."""
    table = fusion_decompositions()
    chosen = ([n for n in gm.graph.nodes if is_candidate(n, table)]
              if backend == "triton" else [])
    traced: dict[torch.fx.Node, torch.fx.GraphModule] = {}
    while chosen:
        graph, env = _copy_graph(gm.graph)
        pieces = {}
        for node in chosen:
            if node not in traced:
                traced[node] = trace_decomposition(node, table)
            pieces[node] = _inline(graph, env[node], traced[node])
        groups = find(graph)
        fused = {n for g in groups for n in g.nodes}
        kept = [n for n in chosen if _fully_fused(pieces[n], fused)]
        if len(kept) == len(chosen):
            logger.debug("decomposed %d composite nodes for fusion: %s", len(kept),
                         sorted({str(n.target) for n in kept}))
            gm.graph = graph
            return gm, groups
        logger.debug("kept whole (pieces not all fused): %s",
                     sorted(n.name for n in chosen if n not in kept))
        chosen = kept
    return gm, find(gm.graph)
