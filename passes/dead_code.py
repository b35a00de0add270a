"""Dead-code elimination: drop nodes whose values nothing reads and that have no effects.

``torch.fx.Graph.eliminate_dead_code`` keeps every op tagged ``nondeterministic_seeded``, so
that removing one cannot shift the random numbers later ops draw. Attention ops carry that tag
for their dropout; called with ``dropout_p=0`` they draw nothing, and an unread one is only
wasted work. AOTAutograd's partitioners copy such calls into backward graphs whose results
nothing reads (a pipeline stage's backward re-ran every block's flash attention forward this
way, doubling the attention forward time per step), so this pass also removes unread seeded ops
whose schema's ``dropout_p`` is 0. An op that draws random numbers stays.
"""

from __future__ import annotations

import torch
import torch.fx

from zeroc.passes.base import PassContext, PassResult

__all__ = ["draws_no_random", "eliminate_dead_code"]


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
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    if target._schema.is_mutable:
        return False
    dropout_p = _argument(node, "dropout_p")
    return isinstance(dropout_p, (int, float)) and not isinstance(dropout_p, bool) \
        and dropout_p == 0


def _has_effect(node: torch.fx.Node) -> bool:
    return node.is_impure() and not draws_no_random(node)


def eliminate_dead_code(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Remove unused nodes that have no effect (see the module docstring)."""
    before = len(gm.graph.nodes)
    changed = gm.graph.eliminate_dead_code(is_impure_node=_has_effect)
    return PassResult(gm, changed, {"removed": before - len(gm.graph.nodes)})
