"""``NodeBuilder``: add nodes to an FX graph with their fake values, as the graph's own have.

Passes that insert computations after a graph was traced (ZeRO's collectives, hpZ's
secondary shards) give each new node ``meta["val"]`` by running its target on the fake values
of its arguments, in the fake mode of the graph's placeholders, so later passes, the
partitioner and the cost model read shapes and dtypes as for any traced node.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from zeroc.runtime.torch_compat import detect_fake_mode

__all__ = ["NodeBuilder"]


class NodeBuilder:
    """Adds nodes to a graph and gives each its fake value, so later passes see metadata."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.graph = gm.graph
        values = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        self.fake_mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])

    def call(self, target: Any, *args: Any) -> torch.fx.Node:
        """A ``call_function`` node of ``target(*args)`` at the graph's insertion point."""
        node = self.graph.call_function(target, args)
        vals = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*vals)
        return node
