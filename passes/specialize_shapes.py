"""Specialize a dynamic-shape Dynamo graph to the sizes of one call.

After a call with a new batch size Dynamo marks the batch dimension dynamic and hands over
one graph for every later size: its size placeholders (``s0``) are ints at run time and its
example values are symbolic. A pipeline cuts the batch into micro-batches at compile time, so
it compiles one static program per distinct set of sizes: this pass copies the graph, puts
the call's ints in place of every use of the size placeholders (the placeholders stay, unused,
so input positions do not move) and recomputes every node's ``example_value`` on fake tensors
of the call's real inputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["size_inputs", "specialize"]


def size_inputs(example_inputs: list[Any]) -> tuple[int, ...]:
    """Positions of the graph inputs that are sizes (ints or SymInts), not tensors."""
    return tuple(i for i, v in enumerate(example_inputs)
                 if isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool))


def _run(node: torch.fx.Node, gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> Any:
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    return getattr(gm, node.target)


def specialize(gm: torch.fx.GraphModule, inputs: list[Any]) -> torch.fx.GraphModule:
    """A static copy of ``gm`` for the call whose (real) graph inputs are ``inputs``."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sizes = {placeholders[i].name: int(inputs[i]) for i in size_inputs(inputs)}
    for node in gm.graph.nodes:
        copied = graph.node_copy(node, lambda n: sizes.get(n.name, env[n]))
        env[node] = copied
    out = torch.fx.GraphModule(gm, graph)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    values: dict[str, Any] = {}
    with fake_mode, torch.enable_grad():
        for node, value in zip((n for n in out.graph.nodes if n.op == "placeholder"), inputs,
                               strict=False):
            fake = fake_mode.from_tensor(value) if isinstance(value, torch.Tensor) else value
            if isinstance(value, torch.Tensor) and value.requires_grad:
                fake = fake.detach().requires_grad_(True)
            values[node.name] = fake
            node.meta["example_value"] = fake
        for node in out.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            args = torch.fx.node.map_arg(node.args, lambda n: values[n.name])
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: values[n.name])
            values[node.name] = _run(node, out, args, kwargs)
            node.meta["example_value"] = values[node.name]
    out.recompile()
    return out
