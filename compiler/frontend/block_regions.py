"""Trace a model's repeated blocks once: Dynamo nested compile regions, inlined afterwards.

Dynamo's trace of a large model is dominated by its repeated blocks (32 decoder layers of a
Llama-7B shape, 80 of a 70B one): it traces each block's forward anew although all of them
run the same code on tensors of the same shapes. ``torch.compiler.nested_compile_region``
tells Dynamo that a function is such a region: it traces the first call into a subgraph and,
where its guards allow, stamps that subgraph out for the next calls (an ``invoke_subgraph``
node each) instead of tracing them again.

``blocks_traced_once(model)`` marks the forward of every *repeated block* for the duration of
a trace: the children of an ``nn.ModuleList`` / ``nn.Sequential`` with at least two children
of one class whose parameters and buffers have the same names, shapes and dtypes. Each block's
class is swapped for a subclass whose ``forward`` is the region, and swapped back afterwards
(an instance attribute ``forward`` would not do: Dynamo then reached the weights through the
block's canonical source and stamped the first block's weights into every block of a model
that loops ``for block in self.layers``). ``inline_block_regions(gm)`` then copies each
``invoke_subgraph`` body into the graph at its call, so what zeroc's passes see is the flat
graph Dynamo traces without the regions: the same ops on the same inputs, each node's
``nn_module_stack`` naming its own block (``model.layers.5.mlp``, not the block the region was
first traced in). A call that reads a sibling block's parameter is refused (``ValueError``):
the caller then traces without regions.

A torch without ``nested_compile_region`` (or with one that refuses these arguments) traces
the blocks one by one as before.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import operator
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch import nn

__all__ = ["blocks_traced_once", "inline_block_regions", "repeated_blocks"]

log = logging.getLogger(__name__)

_FORWARD_OF_SELF = ".forward.__self__"


def _layout(module: nn.Module) -> tuple:
    """What two blocks must share to run one traced region: class, parameter and buffer
    names, shapes and dtypes."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return (type(module), tuple((n, tuple(t.shape), t.dtype) for n, t in tensors))


def repeated_blocks(model: nn.Module) -> list[list[nn.Module]]:
    """Runs of at least two structurally identical children of each ``ModuleList`` or
    ``Sequential`` in ``model`` (a container's children grouped by layout)."""
    found = []
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        groups: dict[tuple, list[nn.Module]] = {}
        for child in container.children():
            groups.setdefault(_layout(child), []).append(child)
        found.extend(group for group in groups.values() if len(group) >= 2)
    return found


def _region(forward: Any, count: int) -> Any:
    region = torch.compiler.nested_compile_region
    if "max_reuse_entries" in inspect.signature(region).parameters:
        # Dynamo re-traces a block its guards refuse to reuse; never raise for that.
        return region(forward, max_reuse_entries=max(8, count))
    return region(forward)


def _flat_call(args: tuple, kwargs: dict) -> tuple[str, list[Any]]:
    """A block call's arguments as a layout string and its leaves, for a region whose inputs
    are all leaves: Dynamo then fingerprints a call by its inputs directly instead of
    tracing a pytree flatten of them (about 60 ms a call, most of a reused call's cost).
    Each argument is one item of the layout, ``;``-separated, keyword ones as ``name=``:
    ``.`` one leaf, ``(n)`` a plain tuple of n leaves (Hugging Face's ``(cos, sin)``). Any
    other value is a leaf as it is; Dynamo fingerprints a call with such a leaf the slow way,
    which handles it."""
    leaves: list[Any] = []
    layout = ""
    for name, value in [("", a) for a in args] + list(kwargs.items()):
        item = "."
        if type(value) is tuple and all(type(v) is not tuple for v in value):
            item = f"({len(value)})"
            leaves.extend(value)
        else:
            leaves.append(value)
        layout = f"{layout};{name}={item}" if layout else f"{name}={item}"
    return layout, leaves


def _unflat_call(layout: str, leaves: tuple) -> tuple[list[Any], dict[str, Any]]:
    """``_flat_call``'s arguments back from its layout and leaves."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    at = 0
    for entry in layout.split(";") if layout else []:
        name, _, item = entry.partition("=")
        count = 1 if item == "." else int(item[1:-1])
        value = leaves[at] if item == "." else tuple(leaves[at:at + count])
        at += count
        if name:
            kwargs[name] = value
        else:
            args.append(value)
    return args, kwargs


_REGION_CLASSES: dict[tuple[type, int], type] = {}


def _region_class(cls: type, count: int) -> type:
    """A subclass of ``cls`` whose ``forward`` calls a nested compile region with the
    call's arguments flattened to leaves (``_flat_call``)."""
    key = (cls, count)
    if key not in _REGION_CLASSES:
        plain_forward = cls.forward

        def region_body(self: nn.Module, layout: str, *leaves: Any) -> Any:
            args, kwargs = _unflat_call(layout, leaves)
            return plain_forward(self, *args, **kwargs)

        region = _region(region_body, count)

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            layout, leaves = _flat_call(args, kwargs)
            return region(self, layout, *leaves)

        sub = type(cls.__name__, (cls,), {"__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        # Set after the class exists: an ``__init_subclass__`` may wrap a subclass's forward
        # (transformers' GradientCheckpointingLayer does), which would hide the region.
        sub.forward = forward
        _REGION_CLASSES[key] = sub
    return _REGION_CLASSES[key]


@contextlib.contextmanager
def blocks_traced_once(model: nn.Module) -> Iterator[int]:
    """Make every repeated block's forward a nested compile region while Dynamo traces
    ``model`` (each block's class is swapped for a subclass whose ``forward`` is the region,
    and swapped back afterwards); yields how many blocks were marked (0 when this torch has
    no regions)."""
    marked: list[tuple[nn.Module, type]] = []
    if hasattr(torch.compiler, "nested_compile_region"):
        for group in repeated_blocks(model):
            cls = type(group[0])
            if "forward" in group[0].__dict__ or not isinstance(cls.forward, types.FunctionType):
                continue  # an instance-level forward, or one that is not plain Python
            region_class = _region_class(cls, len(group))
            for block in group:
                marked.append((block, cls))
                block.__class__ = region_class
    try:
        yield len(marked)
    finally:
        for block, cls in reversed(marked):
            block.__class__ = cls


def _is_region_call(node: torch.fx.Node) -> bool:
    region = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    return node.op == "call_function" and region is not None and node.target is region


def _module_path(path: str) -> str | None:
    """``model.layers.3`` for Dynamo's ``L['self'].model.layers.3`` (or ``L['args'][0]...``,
    ``L['fn']...``); ``None`` for a path from elsewhere."""
    for root in ("L['self']", "L['args'][0]", "L['fn']"):
        if path.startswith(root):
            return path[len(root):].lstrip(".")
    return None


def _check_own_inputs(call: torch.fx.Node, operands: list[Any], call_stack: dict) -> None:
    """Every parameter a block's region call reads must be that block's own: a parameter of
    a sibling block means Dynamo stamped the region out with the wrong inputs."""
    from zeroc.frontend.capture import source_name

    block = _module_path(str(list(call_stack.values())[-1][0])) if call_stack else None
    if not block or "." not in block:
        return
    container = block.rsplit(".", 1)[0] + "."
    for operand in operands:
        if not (isinstance(operand, torch.fx.Node) and operand.op == "placeholder"):
            continue
        name = source_name(operand)
        if name.startswith(container) and not name.startswith(block + "."):
            raise ValueError(f"invoke_subgraph {call.name} (block {block}) reads {name}")


def _resolver(model: nn.Module | None) -> Any:
    """``path -> str(id(module))`` for a Dynamo module path of ``model`` (as Dynamo keys a
    flat trace's stacks), or ``None`` where the path does not resolve."""
    @functools.cache  # a 32-layer model names a few hundred paths, each many times
    def key(path: str) -> str | None:
        dotted = _module_path(path) if model is not None else None
        if dotted is None:
            return None
        try:
            return str(id(model.get_submodule(dotted))) if dotted else str(id(model))
        except AttributeError:
            return None

    return key


def _plain_stack(stack: dict, key_of: Any) -> dict:
    """``stack`` with the bound-method hop a marked block adds to its paths
    (``layers.3.forward.__self__.mlp``) taken out, as a flat trace records it."""
    plain = {}
    for key, (path, kind) in stack.items():
        path = str(path)
        if _FORWARD_OF_SELF in path:
            path = path.replace(_FORWARD_OF_SELF, "")
            key = key_of(path) or key
        plain[key] = (path, kind)
    return plain


def _fold_size_reads(gm: torch.fx.GraphModule) -> None:
    """Replace reads of a tensor's size inside an inlined body (``x.size()[0]``, which
    Dynamo records in a region where a flat trace uses the size itself) by the graph's own
    size input (a symbol) or the constant; the reads left unused are dropped."""
    symbols = {}
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if node.op == "placeholder" and isinstance(value, torch.SymInt):
            symbols.setdefault(str(value.node.expr), node)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not operator.getitem:
            continue
        source = node.args[0]
        if not (isinstance(source, torch.fx.Node) and source.op == "call_method"
                and source.target == "size" and not source.kwargs and len(source.args) == 1):
            continue
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt) and str(value.node.expr) in symbols:
            node.replace_all_uses_with(symbols[str(value.node.expr)])
        elif isinstance(value, int) and not isinstance(value, bool):
            node.replace_all_uses_with(value)
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and (node.op == "call_method" and node.target == "size" or (
                node.op == "call_function" and node.target is operator.getitem
                and isinstance(node.args[0], torch.fx.Node) and node.args[0].op ==
                "call_method" and node.args[0].target == "size")):
            gm.graph.erase_node(node)


def _rebased_stack(inner: dict, call: dict, key_of: Any) -> dict:
    """``inner`` (a region body's module stack, recorded in the block where the region was
    first traced) as it reads at a call whose own stack is ``call`` (its block last)."""
    entries = list(inner.items())
    if not call or len(entries) < len(call):
        return dict(call)
    here, traced_at = str(list(call.values())[-1][0]), str(entries[len(call) - 1][1][0])
    stack = dict(call)
    for key, (path, kind) in entries[len(call):]:
        path = str(path)
        for prefix in (traced_at + _FORWARD_OF_SELF, traced_at):
            if path == prefix or path.startswith(prefix + "."):
                path = here + path[len(prefix):]
                break
        stack[key_of(path) or f"{key}@{here}"] = (path, kind)
    return stack


def _inline_one(gm: torch.fx.GraphModule, call: torch.fx.Node, key_of: Any) -> None:
    graph = gm.graph
    body_attr, _, *operands = call.args
    body = getattr(gm, body_attr.target)
    inline_block_regions(body, None)  # a region inside a region: flat first
    call_stack = call.meta.get("nn_module_stack") or {}
    _check_own_inputs(call, operands, call_stack)
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands):
        raise ValueError(f"invoke_subgraph {call.name}: {len(operands)} operands for "
                         f"{len(placeholders)} inputs")
    env: dict[torch.fx.Node, Any] = dict(zip(placeholders, operands, strict=True))
    for inner, operand in env.items():
        # An input Dynamo lifted at this call (a reused region's block parameters) records
        # only the call's stack; give it the stack its body input records, rebased here.
        if (isinstance(operand, torch.fx.Node) and operand.op == "placeholder"
                and "nn_module_stack" in inner.meta
                and _plain_stack(operand.meta.get("nn_module_stack") or {}, key_of)
                == _plain_stack(call_stack, key_of)):
            operand.meta["nn_module_stack"] = _rebased_stack(
                inner.meta["nn_module_stack"], call_stack, key_of)
    outputs: Any = None
    with graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs = torch.fx.node.map_arg(node.args[0], lambda n: env[n])
                break
            if node.op == "get_attr":
                value = operator.attrgetter(node.target)(body)
                name = f"_region_{body_attr.target}_{node.target.replace('.', '_')}"
                if not hasattr(gm, name):
                    gm.register_buffer(name, value) if isinstance(value, torch.Tensor) \
                        else setattr(gm, name, value)
                copied = graph.get_attr(name)
                copied.meta = dict(node.meta)
            else:
                copied = graph.node_copy(node, lambda n: env[n])
                if "nn_module_stack" in node.meta:
                    copied.meta["nn_module_stack"] = _rebased_stack(
                        node.meta["nn_module_stack"], call_stack, key_of)
            env[node] = copied
    results = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    for user in list(call.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise ValueError(f"invoke_subgraph {call.name} is used by {user.format_node()}")
        user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(call)


def inline_block_regions(gm: torch.fx.GraphModule, model: nn.Module | None) -> int:
    """Copy every ``invoke_subgraph`` body of ``gm`` into the graph at its call (in place);
    returns how many calls were inlined. ``model``: the traced module, whose module ids key
    the rebased ``nn_module_stack`` entries as Dynamo keys a flat trace."""
    calls = [n for n in gm.graph.nodes if _is_region_call(n)]
    if not calls:
        return 0
    key_of = _resolver(model)
    for call in calls:
        _inline_one(gm, call, key_of)
    for node in gm.graph.nodes:
        if "nn_module_stack" in node.meta:
            node.meta["nn_module_stack"] = _plain_stack(node.meta["nn_module_stack"], key_of)
    _fold_size_reads(gm)
    for node in [n for n in gm.graph.nodes if n.op == "get_attr" and not n.users]:
        target = node.target
        gm.graph.erase_node(node)
        if isinstance(getattr(gm, target, None), torch.fx.GraphModule):
            delattr(gm, target)
    gm.graph.lint()
    gm.recompile()
    return len(calls)
