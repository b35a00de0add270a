"""Grouping of graph nodes into fusible kernels (the analysis half of the fusion pass).

A :class:`Group` is a set of nodes sharing one ``rows x cols`` iteration space. The
*level* of a value says how it maps onto that space: ``"full"`` (flat index ``r * cols + c``,
last dim ``cols``) or ``"row"`` (flat index ``r``). Every view in a group reinterprets a
contiguous tensor, so flat order is preserved. An argument is read ``"full"``, ``"row"``,
``"col"`` or ``"scalar"``, decided by how it broadcasts against the consumer's shape; a value
produced inside the group must be read at the level it was produced at.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx

from zeroc.codegen.aten_lowering import op_kind, pow_supported

aten = torch.ops.aten

FUSIBLE_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.bool})
_DIMS_ARG = {aten.sum.dim_IntList: 1, aten.mean.dim: 1, aten.amax.default: 1,
             aten.amin.default: 1, aten.var_mean.correction: 1, aten.var.correction: 1}
_DIM_ARG = {aten._softmax.default: 1, aten._log_softmax.default: 1,
            aten._softmax_backward_data.default: 2, aten._log_softmax_backward_data.default: 2}
_TO_COPY_KWARGS = frozenset({"dtype", "layout", "device", "memory_format", "pin_memory",
                             "non_blocking"})


@dataclasses.dataclass(eq=False)
class Group:
    """Nodes (in graph order) that become one kernel, with their levels and external reads.

    ``levels[node]`` holds one level per output of ``node``; ``reads[node]`` lists the
    arguments of ``node`` produced outside the group with the access used to load them.
    """

    gid: int
    rows: int
    cols: int
    nodes: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    levels: dict[torch.fx.Node, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    reads: dict[torch.fx.Node, tuple[tuple[torch.fx.Node, str], ...]] = dataclasses.field(
        default_factory=dict)
    reductions: int = 0
    pointwise: int = 0

    def add(self, node: torch.fx.Node, levels: tuple[str, ...],
            reads: tuple[tuple[torch.fx.Node, str], ...]) -> None:
        """Append ``node`` (its output levels and external reads)."""
        self.nodes.append(node)
        self.levels[node] = levels
        self.reads[node] = reads
        kind = op_kind(node.target)
        self.reductions += kind == "reduction"
        self.pointwise += kind == "pointwise"


def _outputs(node: torch.fx.Node) -> list[torch.Tensor] | None:
    val = node.meta.get("val")
    vals = list(val) if isinstance(val, (tuple, list)) else [val]
    if not vals or not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    return vals


def _static(t: torch.Tensor) -> bool:
    return all(isinstance(d, int) for d in t.shape)


def _is_last_dim(dim: object, ndim: int) -> bool:
    return isinstance(dim, int) and ndim >= 1 and dim % ndim == ndim - 1


def _op_args_supported(node: torch.fx.Node, x: torch.Tensor) -> bool:
    target, args, kwargs = node.target, node.args, node.kwargs
    if target in _DIMS_ARG:
        dims = args[_DIMS_ARG[target]] if len(args) > 1 else kwargs.get("dim")
        if dims is None:
            dims = [x.dim() - 1] if x.dim() == 1 else None
        return (dims is not None and len(dims) == 1 and _is_last_dim(dims[0], x.dim())
                and kwargs.get("dtype") is None)
    if target in _DIM_ARG:
        return _is_last_dim(args[_DIM_ARG[target]], x.dim())
    if target is aten.native_layer_norm.default:
        return len(args[1]) == 1
    if target is aten.pow.Tensor_Scalar:
        return pow_supported(args[1])
    if target is aten._to_copy.default:
        return (set(kwargs) <= _TO_COPY_KWARGS and kwargs.get("device") in (None, x.device)
                and kwargs.get("layout") in (None, torch.strided))
    if target is aten.where.self:
        cond = args[0]
        return isinstance(cond, torch.fx.Node) and cond.meta["val"].dtype == torch.bool
    return True


def eligible(node: torch.fx.Node) -> bool:
    """Whether ``node`` could be part of some fused kernel (independently of any group)."""
    if node.op != "call_function" or op_kind(node.target) is None:
        return False
    outs = _outputs(node)
    if outs is None or len(node.all_input_nodes) == 0:
        return False
    if len(outs) > 1 and not all(u.target is operator.getitem for u in node.users):
        return False
    device = outs[0].device
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.device != device:
            return False
        outs = outs + [val]
    if not all(t.dtype in FUSIBLE_DTYPES and _static(t) and t.numel() > 0 for t in outs):
        return False
    return _op_args_supported(node, node.all_input_nodes[0].meta["val"])


def output_level(shape: tuple[int, ...], rows: int, cols: int) -> str | None:
    """Level of a tensor of ``shape`` in a ``rows x cols`` space (None: it does not fit)."""
    numel = math.prod(shape)
    if numel == rows * cols and len(shape) >= 1 and shape[-1] == cols:
        return "full"
    if numel == rows:
        return "row"
    return None


def access(arg_shape: tuple[int, ...], shape: tuple[int, ...], level: str) -> str | None:
    """How an argument of ``arg_shape`` is read by an op iterating over ``shape`` at
    ``level`` (aten broadcasting: shapes aligned on the right)."""
    if len(arg_shape) > len(shape):
        return None
    padded = (1,) * (len(shape) - len(arg_shape)) + tuple(arg_shape)
    if padded == tuple(shape):
        return level
    if all(d == 1 for d in padded):
        return "scalar"
    if level != "full":
        return None
    if padded[-1] == 1 and padded[:-1] == tuple(shape[:-1]):
        return "row"
    if all(d == 1 for d in padded[:-1]) and padded[-1] == shape[-1]:
        return "col"
    return None


def fit(node: torch.fx.Node, group: Group):
    """``(levels, reads)`` for ``node`` joining ``group``, or None when it cannot."""
    kind = op_kind(node.target)
    outs = _outputs(node)
    levels = tuple(output_level(tuple(v.shape), group.rows, group.cols) for v in outs)
    if None in levels:
        return None
    first = tuple(node.all_input_nodes[0].meta["val"].shape)
    if kind == "reduction":
        if group.cols == 1 or output_level(first, group.rows, group.cols) != "full":
            return None
        shape, level = first, "full"
    elif kind in ("view", "identity"):
        if output_level(first, group.rows, group.cols) != levels[0]:
            return None
        shape, level = tuple(outs[0].shape), levels[0]
    else:
        shape, level = tuple(outs[0].shape), levels[0]
    reads: list[tuple[torch.fx.Node, str]] = []
    for i, arg in enumerate(node.all_input_nodes):
        if kind in ("view", "identity") and i == 0:
            how = levels[0]
        else:
            how = access(tuple(arg.meta["val"].shape), shape, level)
        if how is None:
            return None
        if arg in group.levels:
            if group.levels[arg] != (how,):
                return None
        else:
            reads.append((arg, how))
    return levels, tuple(reads)


def _new_group(node: torch.fx.Node, gid: int) -> Group | None:
    kind = op_kind(node.target)
    if kind not in ("pointwise", "reduction", "broadcast"):
        return None
    source = node.all_input_nodes[0] if kind == "reduction" else node
    val = source.meta["val"]
    shape = tuple((val[0] if isinstance(val, (tuple, list)) else val).shape)
    cols = shape[-1] if shape else 1
    return Group(gid, math.prod(shape) // cols, cols)


def find_groups(graph: torch.fx.Graph) -> list[Group]:
    """Greedy, graph-ordered grouping; returns the groups worth a kernel (two or more compute
    ops, or at least one reduction)."""
    groups: list[Group] = []
    group_of: dict[torch.fx.Node, Group] = {}
    upstream: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        joined: Group | None = None
        if node.op == "call_function" and node.target is operator.getitem:
            source = node.args[0]
            if source in group_of:
                joined = group_of[source]
                joined.add(node, (joined.levels[source][node.args[1]],), ())
        elif eligible(node):
            candidates = {id(group_of[a]): group_of[a] for a in node.all_input_nodes
                          if a in group_of}.values()
            ranked = sorted(candidates, key=lambda g: (g.reductions > 0, g.rows * g.cols,
                                                       len(g.nodes)), reverse=True)
            for group in ranked:
                bit = 1 << group.gid
                if any(upstream[a] & bit for a in node.all_input_nodes
                       if group_of.get(a) is not group):
                    continue
                placement = fit(node, group)
                if placement is not None:
                    group.add(node, *placement)
                    joined = group
                    break
            if joined is None:
                group = _new_group(node, len(groups))
                placement = fit(node, group) if group is not None else None
                if placement is not None:
                    group.add(node, *placement)
                    groups.append(group)
                    joined = group
        mask = 0
        for arg in node.all_input_nodes:
            mask |= upstream.get(arg, 0)
            if arg in group_of:
                mask |= 1 << group_of[arg].gid
        upstream[node] = mask
        if joined is not None:
            group_of[node] = joined
    groups = merge_groups(graph, groups)
    return [g for g in groups if g.reductions > 0 or g.pointwise >= 2]


def _rebuild(nodes: list[torch.fx.Node], rows: int, cols: int, gid: int) -> Group | None:
    """A group of ``nodes`` (graph order) re-fitted from scratch, or None if one won't fit."""
    group = Group(gid, rows, cols)
    for node in nodes:
        if node.target is operator.getitem:
            source = node.args[0]
            group.add(node, (group.levels[source][node.args[1]],), ())
            continue
        placement = fit(node, group)
        if placement is None:
            return None
        group.add(node, *placement)
    return group


def _creates_cycle(first: Group, second: Group, group_of: dict[torch.fx.Node, Group]) -> bool:
    """Whether a path leaves ``first`` or ``second`` and re-enters either of them (other groups
    count as single nodes, since each becomes one kernel)."""
    members = set(first.nodes) | set(second.nodes)
    frontier = [u for n in members for u in n.users if u not in members]
    seen: set[torch.fx.Node] = set()
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        if node in members:
            return True
        seen.add(node)
        group = group_of.get(node)
        spread = group.nodes if group is not None else [node]
        for member in spread:
            seen.add(member)
            frontier += [u for u in member.users if u not in seen]
    return False


def _merged_space(first: Group, second: Group) -> tuple[int, int] | None:
    """The iteration space of ``first`` and ``second`` merged: their common one, or, for a
    group of per-row values (``rows x 1``, e.g. ``rstd / cols`` in a layer-norm backward) and
    a group with the same rows, the wider one; None when they cannot share one."""
    if (first.rows, first.cols) == (second.rows, second.cols):
        return first.rows, first.cols
    if first.rows == second.rows and min(first.cols, second.cols) == 1:
        return first.rows, max(first.cols, second.cols)
    return None


def merge_groups(graph: torch.fx.Graph, groups: list[Group]) -> list[Group]:
    """Merge groups of one iteration space (or a per-row group into a wider group of the same
    rows) when one feeds the other or both read the same tensor, and the merged group still
    fits and creates no cycle."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    changed = True
    while changed:
        changed = False
        group_of = {n: g for g in groups for n in g.nodes}
        for group in groups:
            neighbours: list[Group] = []
            for reads in group.reads.values():
                for arg, _ in reads:
                    other = group_of.get(arg)
                    if other is None:
                        other_readers = [group_of[u] for u in arg.users if u in group_of]
                        neighbours += [g for g in other_readers if g is not group]
                    elif other is not group:
                        neighbours.append(other)
            for other in dict.fromkeys(neighbours):
                space = _merged_space(group, other)
                if space is None or _creates_cycle(group, other, group_of):
                    continue
                nodes = sorted(group.nodes + other.nodes, key=position.__getitem__)
                merged = _rebuild(nodes, *space, group.gid)
                if merged is None:
                    continue
                groups = [merged if g is group else g for g in groups if g is not other]
                changed = True
                break
            if changed:
                break
    return groups
