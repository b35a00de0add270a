"""Exact loss semantics for pipelines: the loss as a sum over samples and its normaliser.

A pipeline runs the model's graph once per micro-batch. Averaging the micro-batches' losses
is right only for a mean over equal-sized micro-batches: a sum loss comes out 1/N too small,
and a mean over non-ignored tokens (``ignore_index``) is wrong whenever the micro-batches hold
different numbers of them. This pass proves the loss's reduction from the Dynamo graph and
rewrites the loss into its *numerator*, a sum over the micro-batch's elements, so the
pipeline can add the micro-batches' numerators and divide once by the *denominator* computed
from the whole batch (Megatron's token-count normalisation):

- ``F.cross_entropy`` / ``F.nll_loss`` / ``zeroc::linear_cross_entropy`` with reduction
  ``"mean"``: numerator the same loss with ``"sum"``; denominator the count of targets that are
  not ``ignore_index``. Reduction ``"sum"``: no denominator.
- ``x.mean()`` / ``torch.mean(x)`` over all elements: numerator ``x.sum()``, denominator
  ``x.numel()`` of the whole batch. ``x.sum()``: no denominator.
- ``a / b`` where ``b`` does not depend on a parameter (a user's own token mean, as
  ``(loss * mask).sum() / mask.sum()``) and ``a`` is one of the above: denominator ``b``.
- casts, views and multiplication by a number pass through (they are linear).

Anything else is refused with an error that says what was found and which option to pass.
``denominator`` is a graph over the same placeholders that computes the normaliser from the
full-batch inputs; ``None`` means 1.

``normalize_loss(gm, ctx)`` is the pass (``run_passes``, with a
``zeroc.passes.front.context.FrontContext``): ``loss_to_numerator`` in place with
``ctx.params`` and ``ctx.config.loss_reduction``, the ``LossNormalization`` published as
``ctx.normalization``.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from zeroc.passes.base import PassContext, PassResult
from zeroc.passes.dead_code import has_effect
from zeroc.passes.front.context import front_context
from zeroc.runtime.torch_compat import tree_flatten

__all__ = ["LossNormalization", "LossReductionError", "loss_to_numerator", "normalize_loss"]

_CROSS_ENTROPY = {F.cross_entropy, F.nll_loss}
_SIGNATURES = {f: inspect.signature(f) for f in _CROSS_ENTROPY}
_MEAN = {torch.mean, "mean"}
_SUM = {torch.sum, "sum"}
_PASS_THROUGH = {"to", "float", "double", "half", "bfloat16", "type_as", "view", "reshape",
                 "squeeze", "contiguous"}
_DIV = {operator.truediv, torch.div, torch.true_divide, "div", "true_divide"}
_MUL = {operator.mul, torch.mul, "mul"}


class LossReductionError(ValueError):
    """The pipeline cannot prove how the loss is reduced."""


@dataclasses.dataclass(frozen=True)
class LossNormalization:
    """How the pipelined loss is put back together: ``sum(numerators) / denominator``."""

    kind: str  # "sum", "mean" (over elements) or "token_mean" (over non-ignored targets)
    denominator: torch.fx.GraphModule | None

    def describe(self) -> str:
        """A line for the plan."""
        return {"sum": "sum over micro-batches",
                "mean": "sum over micro-batches / elements of the batch",
                "token_mean": "sum over micro-batches / non-ignored targets of the batch",
                "micro_mean": "mean of the micro-batches' losses (loss_reduction='mean')",
                }[self.kind]


def _key(node: torch.fx.Node) -> Any:
    return node.target


def _value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else node


def reads_parameter(node: torch.fx.Node, params: set[str]) -> bool:
    """Whether ``node`` depends on a placeholder named in ``params``."""
    seen, work = set(), [node]
    while work:
        current = work.pop()
        if current.name in seen:
            continue
        seen.add(current.name)
        if current.op == "placeholder" and current.name in params:
            return True
        work.extend(current.all_input_nodes)
    return False


def _denominator_graph(gm: torch.fx.GraphModule, build: Any) -> torch.fx.GraphModule:
    """A graph over ``gm``'s placeholders whose output is ``build(graph, env)``."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])

    def copy(node: torch.fx.Node) -> torch.fx.Node:
        if node not in env:
            for arg in node.all_input_nodes:
                copy(arg)
            env[node] = graph.node_copy(node, lambda n: env[n])
        return env[node]

    graph.output(build(graph, copy))
    return torch.fx.GraphModule(gm, graph)


def _count_graph(gm: torch.fx.GraphModule, target: torch.fx.Node,
                 ignore_index: int) -> torch.fx.GraphModule:
    def build(graph: torch.fx.Graph, copy: Any) -> torch.fx.Node:
        kept = graph.call_function(torch.ne, (copy(target), ignore_index))
        return graph.call_method("sum", (kept,))

    return _denominator_graph(gm, build)


def _cross_entropy_args(node: torch.fx.Node) -> tuple[torch.fx.Node, int, str] | None:
    """(target, ignore_index, reduction) of a cross-entropy node, or None if unsupported."""
    if node.target is torch.ops.zeroc.linear_cross_entropy.default:
        return node.args[3], int(node.args[4]), str(node.args[5])
    args = _bound(node)
    if args is None or args["weight"] is not None or args["size_average"] is not None \
            or args["reduce"] is not None:
        return None
    ignore_index, reduction = args["ignore_index"], args["reduction"]
    if isinstance(ignore_index, torch.fx.Node) or not isinstance(reduction, str):
        return None
    return args["target"], int(ignore_index), reduction


def _bound(node: torch.fx.Node) -> dict[str, Any] | None:
    """Every argument of an ``F.cross_entropy`` / ``F.nll_loss`` call by name, positional or
    keyword as the call gave them (defaults filled in); None when they do not bind."""
    try:
        bound = _SIGNATURES[node.target].bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _rewrite(gm: torch.fx.GraphModule, node: torch.fx.Node,
             params: set[str]) -> tuple[str, torch.fx.GraphModule | None] | str:
    """Make ``node`` a sum over elements; return (kind, denominator) or why it cannot."""
    key = _key(node)
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        if isinstance(source, torch.fx.Node) and \
                source.target is torch.ops.zeroc.linear_cross_entropy.default:
            return _rewrite(gm, source, params)
    if key in _CROSS_ENTROPY or key is torch.ops.zeroc.linear_cross_entropy.default:
        args = _cross_entropy_args(node)
        if args is None:
            return (f"{node.target.__name__} with class weights, the legacy size_average/reduce "
                    "arguments or a computed ignore_index")
        target, ignore_index, reduction = args
        if reduction == "sum":
            return "sum", None
        if reduction != "mean":
            return f"cross-entropy with reduction={reduction!r}"
        if key is torch.ops.zeroc.linear_cross_entropy.default:
            node.args = (*node.args[:5], "sum", *node.args[6:])
        else:  # every argument by keyword: the call may have given reduction by position
            named = _bound(node)
            first, second = list(named)[:2]
            node.args = (named.pop(first), named.pop(second))
            node.kwargs = {**named, "reduction": "sum"}
        return "token_mean", _count_graph(gm, target, ignore_index)
    if key in _SUM and len(node.args) == 1 and not node.kwargs.get("dim"):
        return "sum", None
    if key in _MEAN and len(node.args) == 1 and not node.kwargs.get("dim"):
        numel = int(_value(node.args[0]).numel())
        node.target = torch.sum if node.op == "call_function" else "sum"
        return "mean", _denominator_graph(
            gm, lambda graph, copy: graph.call_function(torch.scalar_tensor, (float(numel),)))
    if key in _PASS_THROUGH and isinstance(node.args[0], torch.fx.Node):
        return _rewrite(gm, node.args[0], params)
    if key in _MUL and len(node.args) == 2:
        tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if len(tensors) == 1 and isinstance(_value(tensors[0]), torch.Tensor):
            return _rewrite(gm, tensors[0], params)
    if key in _DIV and len(node.args) == 2 and isinstance(node.args[0], torch.fx.Node):
        numerator, divisor = node.args
        if isinstance(divisor, (int, float)):
            return _rewrite(gm, numerator, params)
        if isinstance(divisor, torch.fx.Node) and not reads_parameter(divisor, params):
            inner = _rewrite(gm, numerator, params)
            if isinstance(inner, str) or inner[0] != "sum":
                return inner if isinstance(inner, str) else (
                    f"a division of a {inner[0]} loss by a batch statistic")
            node.replace_all_uses_with(numerator)
            return "token_mean", _denominator_graph(gm, lambda graph, copy: copy(divisor))
    name = node.target if isinstance(node.target, str) else getattr(
        node.target, "__name__", str(node.target))
    return f"the loss is computed by {name}"


def normalize_loss(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Pass: ``loss_to_numerator`` of ``gm`` (in place) with ``ctx.params`` and the config's
    ``loss_reduction``; publishes ``ctx.normalization``."""
    front = front_context(ctx, "normalize_loss")
    if front.loss_output is not None and front.loss_output.index is None:
        front.normalization = LossNormalization("sum", None)  # an evaluation without a loss
        return PassResult(gm, False, {"kind": "none"})
    nodes = len(gm.graph.nodes)
    front.normalization = found = loss_to_numerator(gm, front.params,
                                                    ctx.config.loss_reduction)
    # "mean" and "token_mean" rewrite the loss into a sum; dead code may go with it.
    changed = found.kind in ("mean", "token_mean") or len(gm.graph.nodes) != nodes
    return PassResult(gm, changed, {"kind": found.kind,
                                    "denominator": found.denominator is not None})


def loss_to_numerator(gm: torch.fx.GraphModule, param_indices: set[int],
                      loss_reduction: str | None) -> LossNormalization:
    """Rewrite ``gm``'s scalar loss into its numerator in place; return how to normalise.

    ``loss_reduction``: ``None`` derives it from the graph (refusing what it cannot prove);
    ``"sum"`` takes the loss as a sum; ``"mean"`` averages the micro-batches' losses.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = {placeholders[i].name for i in param_indices}
    if loss_reduction == "sum":
        return LossNormalization("sum", None)
    if loss_reduction == "mean":
        return LossNormalization("micro_mean", None)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    # The loss first, then an evaluation graph's per-sample outputs (``passes/front/loss_output``).
    loss = tree_flatten(output.args[0])[0][0]
    found = _rewrite(gm, loss, params)
    if isinstance(found, str):
        raise LossReductionError(
            f"zeroc pipeline: cannot tell how the loss is reduced over the batch ({found}), so "
            "the micro-batches' losses cannot be combined exactly. Return a sum, a mean, "
            "F.cross_entropy(..., reduction='mean' or 'sum', ignore_index=...) or "
            "sum / count, or pass options={'loss_reduction': 'sum'} (the loss is a sum over "
            "samples) or {'loss_reduction': 'mean'} (average the micro-batches' losses)"
        )
    gm.graph.eliminate_dead_code(is_impure_node=has_effect)  # keeps in-place writes
    gm.recompile()
    return LossNormalization(*found)
