"""Fusion: replace chains of pointwise ops and last-dimension reductions by one kernel each.

The pass walks an aten-level functional graph in topological order and grows *groups*. Every
group has an iteration space ``rows x cols`` (``cols`` = last dimension). A node joins the
group of one of its producers when

* its op has a lowering (pointwise, last-dim reduction, composite softmax/layer-norm, view,
  expand, identity) and its tensors are fp32/fp16/bf16/bool with static shapes on one device;
* each of its outputs is *full* (``rows * cols`` elements, last dim ``cols``) or *per-row*
  (``rows`` elements) in that space, and each tensor argument is read in one of the kernel-IR
  access patterns (full, per-row, per-column, scalar), consistently with its producer's level;
* joining creates no cycle (no path leaves the group and comes back).

Groups with at least two compute ops, or with a reduction, become one ``call_function`` node
whose target is a :class:`~zeroc.codegen.fused_kernel.FusedKernel`; matmuls, attention,
indexing and everything else stay aten. One ``KernelInfo`` per kernel goes to ``ctx.kernels``.

Composite ops arrive whole. Those without a lowering of their own (layer-norm backward, MSE)
are decomposed here, and only where all their fusible pieces land in kernels
(``zeroc.passes.decompositions.decompose_where_fused``); what is not fused stays the original
composite aten op.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.node import map_aggregate

from zeroc.codegen.aten_lowering import IRBuilder, lower
from zeroc.codegen.fused_kernel import FusedKernel, choose_backend
from zeroc.codegen.fusion_groups import Group, find_groups
from zeroc.codegen.kernel_ir import FULL, KernelIR, Reduce, Store, TensorSpec, value_levels
from zeroc.codegen.triton_emit import emit_source
from zeroc.passes.base import PassContext, PassResult
from zeroc.passes.decompositions import decompose_where_fused
from zeroc.runtime.cached_files import private_dir
from zeroc.runtime.plan.records import KernelInfo
from zeroc.runtime.torch_compat import unset_fake_temporarily

aten = torch.ops.aten

PERSISTENT_MAX_COLS = 8192

def _dtype_name(node: torch.fx.Node) -> str:
    return str(node.meta["val"].dtype).removeprefix("torch.")


def _aten_graph(gm: torch.fx.GraphModule, group: Group, inputs: list[torch.fx.Node],
                outputs: list[torch.fx.Node]) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, node in enumerate(inputs):
        placeholder = graph.placeholder(f"in{i}")
        placeholder.meta = dict(node.meta)
        env.setdefault(node, placeholder)
    for node in group.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[o] for o in outputs))
    return torch.fx.GraphModule(gm, graph, class_name="FusedGroup")


def build_kernel(gm: torch.fx.GraphModule, group: Group, name_index: int, backend: str,
                 cache_dir: str | None, tune: bool = False,
                 ) -> tuple[FusedKernel, list[torch.fx.Node], list[torch.fx.Node]]:
    """Lower ``group`` to kernel IR and Triton source; return the kernel, the graph nodes it
    reads (in argument order) and the group nodes whose values it returns. ``tune`` is the
    ``kernel_autotune`` option."""
    members = set(group.nodes)
    builder = IRBuilder(cols=group.cols)
    loaded: dict[tuple[torch.fx.Node, str], str] = {}
    inputs: list[torch.fx.Node] = []
    env: dict[torch.fx.Node, object] = {}
    for node in group.nodes:
        if node.target is operator.getitem:
            env[node] = env[node.args[0]][node.args[1]]
            continue
        access = dict(group.reads.get(node, ()))

        def value_of(arg: object, access=access) -> object:
            if not isinstance(arg, torch.fx.Node):
                return arg
            if arg in members:
                return env[arg]
            key = (arg, access[arg])
            if key not in loaded:
                spec = TensorSpec(_dtype_name(arg), tuple(arg.meta["val"].shape), key[1])
                loaded[key] = builder.load(spec)
                inputs.append(arg)
            return loaded[key]

        args = map_aggregate(node.args, value_of)
        kwargs = map_aggregate(dict(node.kwargs), value_of)
        value = lower(builder, node.target, args, kwargs)
        if group.levels[node] == ("full",):
            levels = value_levels(tuple(builder.inputs), tuple(builder.body))
            if levels[value] != FULL:
                value = builder.op("broadcast", value)
        env[node] = value
    outputs = [n for n in group.nodes
               if not isinstance(n.meta["val"], (tuple, list))
               and any(u not in members for u in n.users)]
    out_specs = tuple(TensorSpec(_dtype_name(n), tuple(n.meta["val"].shape),
                                 group.levels[n][0]) for n in outputs)
    stores = tuple(Store(i, env[n]) for i, n in enumerate(outputs))
    body = tuple(builder.body)
    reduces = any(isinstance(s, Reduce) for s in body)
    kind = "reduction" if reduces or any(s.access == "row" for s in out_specs) else "pointwise"
    ir = KernelIR(
        name=f"zeroc_{'red' if kind == 'reduction' else 'poi'}_{name_index}",
        kind=kind, rows=group.rows, cols=group.cols, inputs=tuple(builder.inputs),
        outputs=out_specs, body=body, stores=stores,
        persistent=_next_pow2(group.cols) <= PERSISTENT_MAX_COLS,
    )
    source = emit_source(ir)
    kernel = FusedKernel(ir, source, _aten_graph(gm, group, inputs, outputs), backend, cache_dir,
                         tune)
    return kernel, inputs, outputs


def _outputs_contiguous(group: Group) -> bool:
    members = set(group.nodes)
    for node in group.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and any(u not in members for u in node.users):
            if not value.is_contiguous():
                return False
    return True


def _fusible_groups(graph: torch.fx.Graph) -> list[Group]:
    # A kernel writes contiguous outputs; a value the rest of the graph reads with other
    # strides (later views were traced against them) stays with its aten ops.
    return [g for g in find_groups(graph) if _outputs_contiguous(g)]


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _replace(graph: torch.fx.Graph, group: Group, kernel: FusedKernel,
             inputs: list[torch.fx.Node], outputs: list[torch.fx.Node],
             replaced: dict[torch.fx.Node, torch.fx.Node]) -> None:
    """Put the kernel's node in place of ``group``; ``replaced`` maps erased output nodes of
    earlier groups to the nodes that now hold their values (updated here)."""
    inputs = [replaced.get(n, n) for n in inputs]
    reference = inputs[0].meta["val"]
    # The graph's own fake mode makes them (another fake mode may be active: planning).
    with unset_fake_temporarily():
        fakes = [reference.new_empty(spec.shape, dtype=getattr(torch, spec.dtype))
                 for spec in kernel.ir.outputs]
    with graph.inserting_before(group.nodes[-1]):
        fused = graph.call_function(kernel, tuple(inputs))
        fused.meta["val"] = fakes[0] if len(fakes) == 1 else tuple(fakes)
        fused.meta["zeroc_kernel"] = kernel.ir.name
        if len(outputs) == 1:
            outputs[0].replace_all_uses_with(fused)
            replaced[outputs[0]] = fused
        else:
            for i, out in enumerate(outputs):
                item = graph.call_function(operator.getitem, (fused, i))
                item.meta["val"] = fakes[i]
                out.replace_all_uses_with(item)
                replaced[out] = item
    for node in reversed(group.nodes):
        graph.erase_node(node)


def _topological_order(graph: torch.fx.Graph) -> None:
    """Reorder nodes so every node follows its inputs, keeping the old order otherwise."""
    nodes = list(graph.nodes)
    output = nodes[-1]
    placed: set[torch.fx.Node] = set()
    order: list[torch.fx.Node] = []
    for root in nodes[:-1]:
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in placed:
                continue
            if expanded:
                placed.add(node)
                order.append(node)
                continue
            stack.append((node, True))
            stack += [(i, False) for i in reversed(node.all_input_nodes) if i not in placed]
    for node in order:
        output.prepend(node)


def fusion(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Fuse pointwise/last-dim-reduction groups of ``gm`` into generated kernels.

    Reads ``ctx.config.kernels`` (``"auto"``, ``"triton"`` or ``"aten"``),
    ``ctx.config.cache_dir`` (where generated sources and autotune results go),
    ``ctx.config.kernel_autotune`` (time launch configurations on a GPU; default off) and
    ``ctx.device``. Raises OptionError (a ValueError) when ``kernels="triton"`` cannot run on that
    device, or when its cache directory is not private to the user. With ``ctx.config.fusion``
    off the graph is left as it is (composite ops stay whole).
    """
    backend = choose_backend(getattr(ctx.config, "kernels", "auto"), ctx.device)
    if not getattr(ctx.config, "fusion", True):
        return PassResult(gm, False, {"kernels": 0, "fused_ops": 0})
    cache_dir = getattr(ctx.config, "cache_dir", None)
    tune = bool(getattr(ctx.config, "kernel_autotune", False))
    gm, groups = decompose_where_fused(gm, _fusible_groups, backend)
    fused_ops = 0
    if groups and backend == "triton":
        private_dir(cache_dir)  # refuse a cache others can write now, not at the first launch
    built = [build_kernel(gm, group, len(ctx.kernels) + i, backend, cache_dir, tune)
             for i, group in enumerate(groups)]
    replaced: dict[torch.fx.Node, torch.fx.Node] = {}
    for group, (kernel, inputs, outputs) in zip(groups, built, strict=True):
        compute = [n for n in group.nodes if n.target is not operator.getitem]
        fused_ops += len(compute)
        _replace(gm.graph, group, kernel, inputs, outputs, replaced)
        ir = kernel.ir
        # The launch configuration expected now; the first launch records the real one.
        block = (tuple(kernel.planned_config(ctx.device).to_json().items())
                 if backend == "triton" else ())
        kernel.info = KernelInfo(
            name=ir.name, graph=ctx.graph_name, backend=backend, kind=ir.kind,
            ops=tuple(str(n.target) for n in compute), numel=ir.numel, source=kernel.source,
            source_hash=kernel.source_hash, block=block,
        )
        ctx.kernels.append(kernel.info)
    if groups:
        _topological_order(gm.graph)
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, bool(groups), {"kernels": len(groups), "fused_ops": fused_ops})

