"""Specialize a dynamic-shape Dynamo graph to the sizes of one call.

After a call with a new batch size Dynamo marks the batch dimension dynamic and hands over
one graph for every later size: its size placeholders (``s0``) are ints at run time and its
example values are symbolic. A pipeline cuts the batch into micro-batches at compile time, so
it compiles one static program per distinct set of sizes: this pass copies the graph, puts
the call's ints in place of every use of the size placeholders (the placeholders stay, unused,
so input positions do not move) and recomputes every node's ``example_value`` on fake tensors
of the call's real inputs.

A graph whose batch dimension is symbolic can also be specialized at the *micro-batch* size
(``microbatch_inputs``): every value built from the batch size, an attention mask expanded
to it or a position index broadcast over it, then has the micro-batch's size, exactly as if
the model had been called with one micro-batch. ``zeroc.parallelize(model, pp=...)`` asks
Dynamo for such a graph by marking dimension 0 of the inputs dynamic before the first trace.

The passes (``run_passes``, with a ``zeroc.passes.front.context.FrontContext``):
``specialize`` is ``specialized_copy`` of the graph at ``ctx.inputs`` (``ctx.costs``: costed),
``specialize_outputs`` is ``outputs_only_copy``, or ``specialized_copy`` where that cannot
tell an output's size. ``microbatch_inputs`` makes inputs, not a graph: it is a helper.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
import torch.fx

from zeroc.passes.base import PassContext, PassResult, graph_module
from zeroc.passes.front.context import front_context
from zeroc.passes.front.microbatch_shapes import (
    PLAIN_TYPES,
    SPECIALIZED_RUN,
    CostMode,
    NodeEstimate,
    SpecializedRun,
)
from zeroc.runtime.torch_compat import FakeTensorMode

__all__ = ["OUTPUTS_ONLY", "microbatch_inputs", "outputs_only_copy", "size_inputs",
           "specialize", "specialize_outputs", "specialized_copy"]

# In a graph's ``meta``: set on a ``specialize_outputs`` copy, whose nodes carry no example
# values but the outputs'.
OUTPUTS_ONLY = "zeroc_outputs_only"


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


def _static_copy(gm: torch.fx.GraphModule, inputs: list[Any]
                 ) -> tuple[torch.fx.GraphModule, dict[torch.fx.Node, torch.fx.Node]]:
    """A copy of ``gm`` with the call's ints in place of every use of its size placeholders
    (which stay, unused), and each node of ``gm`` -> its copy. Nodes keep ``gm``'s meta."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sizes = {placeholders[i].name: int(inputs[i]) for i in size_inputs(inputs)}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: sizes.get(n.name, env[n]))
    return graph_module(gm, graph), env  # its code is made if it is ever run


def _cost_key(target: Any, args: tuple, kwargs: dict) -> tuple | None:
    """What a node's cost depends on: its target and, for each argument, a tensor's shape,
    strides, dtype, device and ``requires_grad`` or a plain constant itself; None when an
    argument is neither (its cost is then measured)."""
    parts: list[Any] = [target]

    def add(value: Any) -> bool:
        if isinstance(value, torch.Tensor):
            parts.append((tuple(value.shape), value.stride(), value.dtype, value.device,
                          value.requires_grad))
        elif isinstance(value, (tuple, list)):
            parts.append((type(value), len(value)))
            return all(add(v) for v in value)
        elif isinstance(value, dict):
            parts.append(tuple(value))
            return all(add(v) for v in value.values())
        elif isinstance(value, PLAIN_TYPES) and not isinstance(value, torch.SymInt):
            parts.append((type(value), value))
        else:
            return False
        return True

    return tuple(parts) if add(args) and add(kwargs) else None


def specialize(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Pass: the static copy of the dynamic graph ``gm`` at ``ctx.inputs`` (a new graph;
    ``ctx.costs``: costed), see ``specialized_copy``."""
    front = front_context(ctx, "specialize")
    out = specialized_copy(gm, front.inputs, costs=front.costs)
    return PassResult(out, True, _size_stats(gm, front.inputs) | {"costed": front.costs})


def specialize_outputs(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Pass: ``outputs_only_copy`` of the dynamic graph ``gm`` at ``ctx.inputs`` (a new graph
    that is never run), or, when an output's size cannot be told from the inputs' sizes,
    ``specialized_copy`` (``stats["outputs_only"]`` says which)."""
    front = front_context(ctx, "specialize_outputs")
    out = outputs_only_copy(gm, front.inputs)
    outputs_only = out is not None
    if out is None:
        out = specialized_copy(gm, front.inputs)
    return PassResult(out, True, _size_stats(gm, front.inputs) | {"outputs_only": outputs_only})


def _size_stats(gm: torch.fx.GraphModule, inputs: list[Any]) -> dict[str, Any]:
    """The size placeholders and the ints put in their place, as ``{"sizes": "s0=4"}``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {"sizes": " ".join(f"{placeholders[i].name}={int(inputs[i])}"
                              for i in size_inputs(inputs) if i < len(placeholders)) or "none"}


def specialized_copy(gm: torch.fx.GraphModule, inputs: list[Any],
                     costs: bool = False) -> torch.fx.GraphModule:
    """A static copy of ``gm`` for the call whose (real) graph inputs are ``inputs``.
    ``costs``: also cost every node and keep what its run saw and gave
    (``zeroc.passes.front.microbatch_shapes.SPECIALIZED_RUN``), which ``shrink_to_microbatch``
    reuses for the nodes the passes leave as they are."""
    out, _ = _static_copy(gm, inputs)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    values: dict[str, Any] = {}
    # A node costs what an earlier node of the same target and argument metadata cost (a
    # model's repeated blocks): measured once, its run then goes without the cost meter.
    measured: dict[tuple, NodeEstimate] = {}
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
            if costs and node.op != "get_attr":
                key = _cost_key(node.target, args, kwargs)
                cost = measured.get(key) if key is not None else None
                if cost is None:
                    meter = CostMode()
                    with meter:
                        value = _run(node, out, args, kwargs)
                    cost = NodeEstimate(meter.flops, meter.bytes)
                    if key is not None:
                        measured[key] = cost
                else:
                    value = _run(node, out, args, kwargs)
                node.meta[SPECIALIZED_RUN] = SpecializedRun(node.target, args, kwargs, value,
                                                            cost)
            else:
                value = _run(node, out, args, kwargs)
            values[node.name] = node.meta["example_value"] = value
    return out


def _bindings(placeholders: list[torch.fx.Node], inputs: list[Any]) -> dict[Any, int] | None:
    """Each size symbol of a dynamic graph's inputs -> its value in the call ``inputs``
    (``ShapeEnv.bind_symbols``), or None when the inputs do not fit the graph's symbols."""
    examples, values, shape_env = [], [], None
    for node, value in zip(placeholders, inputs, strict=False):
        example = node.meta.get("example_value")
        if isinstance(example, torch.SymInt):
            sizes, value = (example,), int(value)
        elif isinstance(example, torch.Tensor) and isinstance(value, torch.Tensor):
            sizes = tuple(example.shape)
        else:
            continue
        examples.append(example)
        values.append(value)
        symbol = next((s for s in sizes if isinstance(s, torch.SymInt)), None)
        shape_env = shape_env or (symbol.node.shape_env if symbol is not None else None)
    if shape_env is None:
        return {}
    try:
        return shape_env.bind_symbols(examples, values)
    except AssertionError:  # a symbol bound to two values: not this graph's call
        return None


def _at_call_sizes(example: Any, bound: dict[Any, int]) -> Any:
    """A symbolic example value at the call's sizes: a meta tensor of its shape and dtype, or
    an int; ``None`` when a size is not an integer once the inputs' symbols are bound."""
    def size(value: Any) -> int | None:
        if not isinstance(value, torch.SymInt):
            return int(value)
        concrete = sympy.sympify(value.node.expr.xreplace(bound))
        return int(concrete) if concrete.is_Integer else None

    if isinstance(example, torch.Tensor):
        shape = [size(s) for s in example.shape]
        if None in shape:
            return None
        return torch.empty(shape, dtype=example.dtype, device="meta")
    if isinstance(example, torch.SymInt):
        return size(example)
    if isinstance(example, (bool, int, float)) or example is None:
        return example
    return None


def outputs_only_copy(gm: torch.fx.GraphModule,
                      inputs: list[Any]) -> torch.fx.GraphModule | None:
    """``specialized_copy``'s static copy of ``gm`` without running it: its nodes carry no example
    values but the outputs', each a meta tensor of the shape and dtype the dynamic graph's
    symbolic value has at the call's sizes (``meta[OUTPUTS_ONLY]`` says so). Enough to read
    the graph's structure and what it returns; None when an output's size cannot be told
    from the inputs' sizes."""
    bound = _bindings([n for n in gm.graph.nodes if n.op == "placeholder"], inputs)
    if bound is None:
        return None
    out, env = _static_copy(gm, inputs)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = set(output.all_input_nodes)
    for node, copied in env.items():
        copied.meta.pop("example_value", None)  # the dynamic graph's symbolic value
        if node in returned:
            value = _at_call_sizes(node.meta.get("example_value"), bound)
            if value is None:
                return None
            copied.meta["example_value"] = value
    out.meta[OUTPUTS_ONLY] = True
    return out


def _batch_symbols(placeholders: list[torch.fx.Node], batch_inputs: set[int]) -> set[Any]:
    """The symbols of dimension 0 of the batch inputs, in a dynamic graph's example values."""
    symbols = set()
    for index in sorted(batch_inputs):
        value = placeholders[index].meta.get("example_value")
        size = value.shape[0] if isinstance(value, torch.Tensor) and value.dim() else None
        if isinstance(size, torch.SymInt) and size.node.expr.is_symbol:
            symbols.add(size.node.expr)
    return symbols


def microbatch_inputs(gm: torch.fx.GraphModule, inputs: list[Any], batch_inputs: set[int],
                      microbatch: int) -> list[Any] | None:
    """The graph inputs of one micro-batch of the call ``inputs``, for ``specialize``
    (``FrontContext.inputs``).

    Batch inputs are cut to their first ``microbatch`` rows and the size inputs that stand
    for the batch dimension become ``microbatch``; other sizes keep the call's values. None
    when the graph's batch dimension is not symbolic. Raises ``ValueError`` when the batch's
    symbol also sizes another dimension (Dynamo gives equal dynamic sizes one symbol).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    symbols = _batch_symbols(placeholders, batch_inputs)
    if not symbols:
        return None
    for index in sorted(batch_inputs):
        value = placeholders[index].meta.get("example_value")
        for dim, size in enumerate(value.shape[1:], start=1):
            if isinstance(size, torch.SymInt) and size.node.expr.free_symbols & symbols:
                raise ValueError(
                    f"zeroc pipeline: input {placeholders[index].name} has the batch size "
                    f"in dimension {dim} too ({tuple(value.shape)}), so its micro-batches "
                    "cannot be told apart from it; pass a batch whose size differs from the "
                    "other dynamic sizes")
    micro = list(inputs)
    for index in sorted(batch_inputs):
        micro[index] = inputs[index][:microbatch]
    for index in size_inputs(inputs):
        value = placeholders[index].meta.get("example_value")
        if isinstance(value, torch.SymInt) and value.node.expr in symbols:
            micro[index] = microbatch
    return micro
