"""Dead-code elimination: drop nodes whose values nothing reads and that have no effects."""

from __future__ import annotations

import torch.fx

from zeroc.passes.base import PassContext, PassResult


def eliminate_dead_code(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Remove unused pure nodes (``torch.fx.Graph.eliminate_dead_code`` keeps impure ones)."""
    before = len(gm.graph.nodes)
    changed = gm.graph.eliminate_dead_code()
    return PassResult(gm, changed, {"removed": before - len(gm.graph.nodes)})
