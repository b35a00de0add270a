"""Re-shape a Dynamo graph from the full batch to one micro-batch, and cost every node.

Dynamo traces the model at the batch the user passed, so shape arguments such as
``x.view(batch, seq, heads, head_dim)`` hold the full batch size as a constant. A pipeline runs
every stage on micro-batches of ``batch / microbatches`` rows, so those constants must shrink.

``shrink_to_microbatch(gm, inputs, batch_inputs, batch, microbatch)`` walks the graph once with fake
tensors at the micro-batch size and follows the batch dimension of every value: the batch
inputs carry it in dimension 0; after each node the dimension whose size shrank by the
micro-batch ratio is that value's batch dimension (at most one per tensor). Before running a
``view``/``reshape`` whose input carries the batch dimension, the size argument at the output
position that holds the batch (found by matching the products of the leading sizes) is divided
by the ratio; ``expand`` is right-aligned. Factory calls without tensor inputs (``arange``,
``zeros``) are left alone: their sizes cannot depend on the batch through the graph.

A graph ``zeroc.passes.front.specialize_shapes.specialize(..., costs=True)`` made at the micro-batch
size (a dynamic graph traced for the pipeline) has nothing to shrink (``batch == microbatch``),
and its nodes already carry their fake values and costs from that propagation
(``SPECIALIZED_RUN``): a node whose target and arguments are still what that run saw
(arguments by identity of their values) keeps them, in that run's fake mode, and only what
the passes since changed is run again. A hoisted parameter's placeholder
(``zeroc.passes.front.hoist_unshard``) takes the value its removed gather had there
(``HOISTED_VALUE``) when it matches the full parameter.

Each node also gets a cost from the aten ops it dispatches: matmul/attention FLOPs from
``torch.utils.flop_counter``'s formulas, one FLOP per output element otherwise, and the bytes
it reads and writes (an embedding reads the rows it gathers, not the whole table).

``microbatch_graph(gm, ctx)`` is the pass (``run_passes``, with a
``zeroc.passes.front.context.FrontContext``): ``shrink_to_microbatch`` of ``gm`` with
``ctx.fake_inputs``, ``ctx.batch_inputs``, ``ctx.traced_batch`` and ``ctx.microbatch``; it
returns the new graph and publishes the ``MicrobatchGraph`` as ``ctx.mgraph``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.fx
from torch.utils.flop_counter import flop_registry

import zeroc.runtime.zero_ops  # noqa: F401  (registers zeroc::unshard for fake runs)
from zeroc.passes.base import PassContext, PassResult, graph_module
from zeroc.passes.front.context import front_context
from zeroc.runtime.torch_compat import (
    FakeTensor,
    FakeTensorMode,
    TorchDispatchMode,
    tree_flatten,
    tree_map,
)

_RESHAPES = {"view", "reshape", torch.reshape, torch.Tensor.view, torch.Tensor.reshape}
_EXPANDS = {"expand", torch.Tensor.expand}
_EMBEDDING = torch.ops.aten.embedding.default


@dataclasses.dataclass(frozen=True)
class NodeEstimate:
    """Cost of one Dynamo node at the micro-batch size."""

    flops: int
    bytes: int


SPECIALIZED_RUN = "zeroc_specialized_run"  # node.meta: a SpecializedRun
HOISTED_VALUE = "zeroc_hoisted_value"  # placeholder.meta: the value its removed gather had


@dataclasses.dataclass(frozen=True)
class SpecializedRun:
    """What one node's fake propagation in ``specialize(..., costs=True)`` saw and gave."""

    target: Any
    args: tuple
    kwargs: dict
    out: Any
    cost: NodeEstimate


@dataclasses.dataclass
class MicrobatchGraph:
    """A Dynamo graph rewritten for one micro-batch.

    ``values[name]`` is the fake value of every node at the micro-batch size;
    ``batch_dependent`` names the nodes that depend on a batch input; ``costs`` the
    per-node estimates; ``ratio`` is ``batch // microbatch``; ``resized`` counts the
    view/reshape/expand nodes whose batch size was rewritten.
    """

    gm: torch.fx.GraphModule
    values: dict[str, Any]
    batch_dependent: set[str]
    costs: dict[str, NodeEstimate]
    ratio: int
    resized: int = 0


class CostMode(TorchDispatchMode):
    """Sums FLOPs and bytes of the aten ops dispatched while it is active (``prim`` ops are
    metadata queries: a parameter's ``device`` is asked for depending on how it was made,
    which must not change a node's cost)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":  # a metadata query (``prim.device``): no FLOPs, no bytes
            return out
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        written = sum(t.numel() * t.element_size() for t in outs)
        if func is _EMBEDDING:
            read = written + ins[1].numel() * ins[1].element_size()
        else:
            read = sum(t.numel() * t.element_size() for t in ins)
        formula = flop_registry.get(getattr(func, "overloadpacket", None))
        flops = None
        if formula is not None:
            try:
                flops = int(formula(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not take these arguments
                flops = None
        if flops is None:
            flops = sum(t.numel() for t in outs)
        self.flops += flops
        self.bytes += read + written
        return out


def _tensor_shape(value: Any) -> tuple[int, ...] | None:
    return tuple(int(s) for s in value.shape) if isinstance(value, torch.Tensor) else None


def batch_dim(micro: Any, full: Any, ratio: int, where: str) -> int | None:
    """The dimension of ``micro`` that is ``full``'s divided by ``ratio``; None if none is."""
    micro_shape, full_shape = _tensor_shape(micro), _tensor_shape(full)
    if micro_shape is None or full_shape is None or micro_shape == full_shape:
        return None
    if len(micro_shape) != len(full_shape):
        raise ValueError(f"zeroc pipeline: node {where} changes rank at the micro-batch size")
    shrunk = [d for d, (m, f) in enumerate(zip(micro_shape, full_shape, strict=True)) if m != f]
    if len(shrunk) != 1 or micro_shape[shrunk[0]] * ratio != full_shape[shrunk[0]]:
        raise ValueError(
            f"zeroc pipeline: cannot follow the batch dimension through node {where}: shape "
            f"{full_shape} at the full batch became {micro_shape} at the micro-batch size"
        )
    return shrunk[0]


def _size_args(node: torch.fx.Node) -> tuple[list[Any], bool]:
    """The size arguments of a view/reshape/expand node, and whether they were one tuple."""
    rest = list(node.args[1:])
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        return list(rest[0]), True
    return rest, False


def _set_size_args(node: torch.fx.Node, sizes: list[Any], packed: bool) -> None:
    node.args = (node.args[0], tuple(sizes)) if packed else (node.args[0], *sizes)


def _rewrite_sizes(node: torch.fx.Node, in_dim: int, in_full: tuple[int, ...],
                   out_full: tuple[int, ...], ratio: int) -> None:
    """Shrink the batch entry of a view/reshape/expand size argument in place."""
    sizes, packed = _size_args(node)
    if node.target in _EXPANDS:
        out_dim = in_dim + len(out_full) - len(in_full)
    else:
        leading = math.prod(in_full[:in_dim])
        out_dim = next((j for j in range(len(out_full)) if math.prod(out_full[:j]) == leading),
                       None)
        if out_dim is None or out_full[out_dim] % ratio:
            raise ValueError(
                f"zeroc pipeline: node {node.name} reshapes {in_full} to {out_full} in a way "
                "that mixes the batch dimension with others; micro-batches cannot follow it"
            )
    if len(sizes) != len(out_full) or not isinstance(sizes[out_dim], int):
        return
    if sizes[out_dim] != -1:
        sizes[out_dim] = out_full[out_dim] // ratio
        _set_size_args(node, sizes, packed)


def _run(node: torch.fx.Node, gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> Any:
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return gm.get_submodule(node.target)(*args, **kwargs)


def microbatch_graph(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Pass: ``shrink_to_microbatch`` of ``gm`` (a new graph); publishes ``ctx.mgraph``."""
    front = front_context(ctx, "microbatch_graph")
    front.mgraph = mgraph = shrink_to_microbatch(gm, front.fake_inputs, front.batch_inputs,
                                                 front.traced_batch, front.microbatch)
    return PassResult(mgraph.gm, mgraph.resized > 0, {
        "ratio": mgraph.ratio, "resized": mgraph.resized,
        "batch_dependent": len(mgraph.batch_dependent)})


def shrink_to_microbatch(
    gm: torch.fx.GraphModule,
    inputs: list[Any],
    batch_inputs: set[int],
    batch: int,
    microbatch: int,
) -> MicrobatchGraph:
    """Copy ``gm`` and shrink its batch-size constants from ``batch`` to ``microbatch``.

    ``inputs`` are the graph's example inputs (real tensors); the placeholders whose index is
    in ``batch_inputs`` are split along dimension 0. Raises ``ValueError`` naming the node
    when the batch dimension cannot be followed.
    """
    ratio = batch // microbatch
    # Reuse a micro-batch propagation's values only where nothing is to be shrunk.
    specialized = _specialized_mode(gm) if ratio == 1 else None
    gm = graph_module(gm, _copy_graph(gm))
    fake_mode = specialized or FakeTensorMode(allow_non_fake_inputs=True)
    values: dict[str, Any] = {}
    dims: dict[str, int | None] = {}
    dependent: set[str] = set()
    costs: dict[str, NodeEstimate] = {}
    resized = 0
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with fake_mode, torch.enable_grad():
        for index, (node, value) in enumerate(zip(placeholders, inputs, strict=False)):
            if not isinstance(value, torch.Tensor):
                values[node.name] = value
                continue
            fake = fake_mode.from_tensor(value)
            if index in batch_inputs:
                fake = fake[:microbatch].detach().requires_grad_(value.requires_grad)
                dims[node.name] = 0
                dependent.add(node.name)
            if specialized is not None:
                prior = node.meta.get(HOISTED_VALUE, node.meta.get("example_value"))
                fake = prior if _same_tensor_meta(prior, fake) else fake
            values[node.name] = fake
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op == "get_attr":
                attr = getattr(gm, node.target)  # specialize ran on the attribute itself
                values[node.name] = attr if specialized else fake_mode.from_tensor(attr)
                continue
            feeding = [a.name for a in node.all_input_nodes]
            full = node.meta.get("example_value")
            first = node.args[0] if node.args else None
            if (isinstance(first, torch.fx.Node) and dims.get(first.name) is not None
                    and node.target in _RESHAPES | _EXPANDS):
                in_full = _tensor_shape(first.meta.get("example_value"))
                out_full = _tensor_shape(full)
                if in_full is not None and out_full is not None:
                    sizes = node.args
                    _rewrite_sizes(node, dims[first.name], in_full, out_full, ratio)
                    resized += node.args != sizes
            args = torch.fx.node.map_arg(node.args, lambda n: values[n.name])
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: values[n.name])
            run = node.meta.get(SPECIALIZED_RUN) if specialized is not None else None
            if (run is not None and run.target is node.target and _same(run.args, args)
                    and _same(run.kwargs, kwargs)):
                out, costs[node.name] = run.out, run.cost
            else:
                meter = CostMode()
                with meter:
                    out = _run(node, gm, args, kwargs)
                costs[node.name] = NodeEstimate(meter.flops, meter.bytes)
            values[node.name] = out
            if any(name in dependent for name in feeding):
                dependent.add(node.name)
                dims[node.name] = batch_dim(out, full, ratio, node.name)
            elif _tensor_shape(out) != _tensor_shape(full) and full is not None:
                raise ValueError(f"zeroc pipeline: node {node.name} changed shape without "
                                 "depending on a batch input")
    gm.recompile()
    return MicrobatchGraph(gm=gm, values=values, batch_dependent=dependent, costs=costs,
                           ratio=ratio, resized=resized)


def _specialized_mode(gm: torch.fx.GraphModule) -> FakeTensorMode | None:
    """The fake mode of ``gm``'s ``specialize(..., costs=True)`` propagation, if it had one."""
    for node in gm.graph.nodes:
        run = node.meta.get(SPECIALIZED_RUN)
        if run is not None:
            value = next((v for v in tree_flatten(run.out)[0] if isinstance(v, FakeTensor)),
                         None)
            if value is not None:
                return value.fake_mode
    return None


def _same_tensor_meta(prior: Any, fake: torch.Tensor) -> bool:
    """Whether ``prior`` (a value of the specialized run) stands for ``fake``: a fake tensor
    of the same mode, shape, strides, offset, dtype, device and ``requires_grad``."""
    return (isinstance(prior, FakeTensor) and prior.fake_mode is fake.fake_mode
            and prior.shape == fake.shape and prior.stride() == fake.stride()
            and prior.storage_offset() == fake.storage_offset() and prior.dtype == fake.dtype
            and prior.device == fake.device and prior.requires_grad == fake.requires_grad)


# Argument types compared (and keyed) by value, not identity.
PLAIN_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
               torch.memory_format)


def _same(recorded: Any, current: Any) -> bool:
    """Whether a node's arguments are those its specialized run saw: values by identity,
    plain constants by equality, sequences and dicts element by element."""
    if isinstance(recorded, (tuple, list)) and isinstance(current, (tuple, list)):
        return len(recorded) == len(current) and all(
            _same(a, b) for a, b in zip(recorded, current, strict=True))
    if isinstance(recorded, dict) and isinstance(current, dict):
        return recorded.keys() == current.keys() and all(
            _same(recorded[k], current[k]) for k in recorded)
    if isinstance(recorded, PLAIN_TYPES) and not isinstance(recorded, torch.SymInt):
        return type(recorded) is type(current) and recorded == current
    if isinstance(recorded, slice) and isinstance(current, slice):
        return _same((recorded.start, recorded.stop, recorded.step),
                     (current.start, current.stop, current.step))
    return recorded is current


def _copy_graph(gm: torch.fx.GraphModule) -> torch.fx.Graph:
    """A copy of ``gm.graph`` whose nodes keep their names and metadata."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    return graph


def fake_meta(value: Any) -> Any:
    """``(shape, dtype, requires_grad)`` of a fake tensor, mapped over nested values."""
    return tree_map(
        lambda v: (_tensor_shape(v), v.dtype, v.requires_grad) if isinstance(v, torch.Tensor)
        else v, value)
