"""Remove views, reshapes and expands whose output has the input's shape and strides.

Such nodes change nothing but still cost a dispatch each time the graph runs, and they split
otherwise fusable chains. Every user of a removed node reads its input instead.
"""

from __future__ import annotations

import torch
import torch.fx

from zeroc.passes.base import PassContext, PassResult

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


def remove_noop_views(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace identity views by their input."""
    removed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if getattr(node.target, "overloadpacket", None) not in _SHAPE_OPS:
            continue
        if not _same_layout(node):
            continue
        # An output node must not become the graph's input directly aliasing twice; keep
        # views that feed the output so aliasing metadata computed by AOTAutograd holds.
        if any(user.op == "output" for user in node.users):
            continue
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        removed += 1
    return PassResult(gm, removed > 0, {"removed": removed})
