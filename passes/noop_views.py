"""Remove views, reshapes and expands whose output has the input's shape and strides, and
clones of temporaries that nothing else reads.

Such nodes change nothing but still cost a dispatch each time the graph runs, and they split
otherwise fusable chains. Every user of a removed node reads its input instead.

A clone copies: the decomposition of dropout with ``p=0`` (or in eval mode) is a clone, so a
GPT block with its three dropouts copies the residual stream three times per forward, which
eager dropout does not (it returns its input). In a functional graph nothing is written in
place, so a clone whose input is a fresh temporary read by nothing else (possibly through
views that nothing else reads either) can be that input.
"""

from __future__ import annotations

import torch
import torch.fx

from zeroc.passes.base import PassContext, PassResult
from zeroc.runtime.torch_compat import OpOverload

aten = torch.ops.aten

_SHAPE_OPS = {aten.view, aten._unsafe_view, aten.reshape, aten.expand, aten.alias}


def _same_layout(node: torch.fx.Node) -> bool:
    source = node.args[0]
    if not isinstance(source, torch.fx.Node):
        return False
    out, src = node.meta.get("val"), source.meta.get("val")
    if not isinstance(out, torch.Tensor) or not isinstance(src, torch.Tensor):
        return False
    return out.shape == src.shape and out.stride() == src.stride() and out.dtype == src.dtype


def _only_reader_of_fresh_memory(node: torch.fx.Node) -> bool:
    """Whether ``node``'s input is memory an aten op made new and nothing but ``node`` reads:
    follow views that have one user each down to a non-aliasing op with one user."""
    reader, source = node, node.args[0]
    while isinstance(source, torch.fx.Node) and source.op == "call_function":
        if list(source.users) != [reader]:
            return False
        target = source.target
        if not isinstance(target, OpOverload) or target.namespace != "aten" \
                or target._schema.is_mutable:
            return False
        if not any(r.alias_info is not None for r in target._schema.returns):
            return True
        reader, source = source, source.args[0]
    return False


def _removable(node: torch.fx.Node) -> bool:
    if getattr(node.target, "overloadpacket", None) in _SHAPE_OPS:
        return _same_layout(node)
    if node.target is aten.clone.default:
        return _same_layout(node) and _only_reader_of_fresh_memory(node)
    return False


def remove_noop_views(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace identity views, and clones of unshared temporaries, by their input."""
    removed = clones = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not _removable(node):
            continue
        # An output node must not become the graph's input directly aliasing twice; keep
        # views that feed the output so aliasing metadata computed by AOTAutograd holds.
        if any(user.op == "output" for user in node.users):
            continue
        clones += node.target is aten.clone.default
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        removed += 1
    return PassResult(gm, removed > 0, {"removed": removed, "clones": clones})
