"""Dead-code elimination: drop nodes whose values nothing reads and that have no effects.

``torch.fx.Graph.eliminate_dead_code`` keeps every op tagged ``nondeterministic_seeded``, so
that removing one cannot shift the random numbers later ops draw. Attention ops carry that tag
for their dropout; called with ``dropout_p=0`` they draw nothing, and an unread one is only
wasted work. AOTAutograd's partitioners copy such calls into backward graphs whose results
nothing reads (a pipeline stage's backward re-ran every block's flash attention forward this
way, doubling the attention forward time per step), so this pass also removes unread seeded ops
whose schema's ``dropout_p`` is 0. An op that draws random numbers stays.

Before AOTAutograd functionalizes it, a Dynamo graph writes in place through Torch-level calls
that FX does not count as effects: ``out.add_(bias[ids])`` is a ``call_method`` whose result
nothing reads, so ``Graph.eliminate_dead_code`` alone drops it, and with it every read of
``bias`` (Hugging Face's grouped-MoE experts add their biases this way; the pipeline then
gave those biases no gradient). ``has_effect`` keeps every in-place write: methods named with
a trailing underscore, ``x[i] = v``, in-place operators, and calls given an ``out=`` tensor.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from zeroc.passes.base import PassContext, PassResult
from zeroc.runtime.torch_compat import OpOverload

__all__ = ["draws_no_random", "eliminate_dead_code", "has_effect", "writes_in_place"]


def _argument(node: torch.fx.Node, name: str):
    """The value of ``node``'s schema argument ``name`` (given or default); ``None`` when the
    schema has no such argument."""
    schema = node.target._schema
    for index, arg in enumerate(schema.arguments):
        if arg.name != name:
            continue
        if index < len(node.args):
            return node.args[index]
        if name in node.kwargs:
            return node.kwargs[name]
        return arg.default_value if arg.has_default_value() else None
    return None


def draws_no_random(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a seeded op whose only randomness, its ``dropout_p``, is 0."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    if target._schema.is_mutable:
        return False
    dropout_p = _argument(node, "dropout_p")
    return isinstance(dropout_p, (int, float)) and not isinstance(dropout_p, bool) \
        and dropout_p == 0


_IN_PLACE_OPERATORS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
    operator.ixor, operator.ilshift, operator.irshift, operator.imatmul})


def _in_place_name(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__")


def writes_in_place(node: torch.fx.Node) -> bool:
    """Whether ``node`` (a Dynamo-level or aten node) writes into one of its arguments:
    ``x.add_(y)``, ``torch.Tensor.add_(x, y)``, ``x[i] = v``, ``x += y``, ``torch.add(x, y,
    out=z)`` or an aten op whose schema mutates an argument."""
    target = node.target
    if node.op == "call_method":
        return isinstance(target, str) and _in_place_name(target)
    if node.op != "call_function":
        return False
    if target in _IN_PLACE_OPERATORS or "out" in node.kwargs:
        return True
    if isinstance(target, OpOverload):
        return target._schema.is_mutable
    return _in_place_name(getattr(target, "__name__", ""))


def has_effect(node: torch.fx.Node) -> bool:
    """Whether removing ``node`` could change what the graph computes, even when nothing reads
    its value: FX's own impurity (collectives, random ops other than a zero dropout) or an
    in-place write (see the module docstring)."""
    return (node.is_impure() and not draws_no_random(node)) or writes_in_place(node)


def eliminate_dead_code(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Remove unused nodes that have no effect (see the module docstring)."""
    before = len(gm.graph.nodes)
    changed = gm.graph.eliminate_dead_code(is_impure_node=has_effect)
    return PassResult(gm, changed, {"removed": before - len(gm.graph.nodes)})
