"""Which pipeline stage each unit of a micro-batch graph goes to: the stage balance.

A unit (``zeroc.passes.front.stage_units``: a repeated block, or a module outside the blocks)
costs its estimated time: FLOPs plus bytes moved times ``FLOPS_PER_BYTE`` (so a
memory-bound embedding weighs what it really costs, not zero). Stages are cut only in front
of blocks; the cut points minimise the most expensive stage (``partition_costs``, a
linear-partition dynamic program), unless the user pins them with ``split_points``.
``assign_stages`` gives every batch-dependent node its stage; ``zeroc.passes.front.split_stages``
cuts the graph there. The tuner's screen (``zeroc.tuning.tune_screen``) cuts its per-op
costs with the same ``partition_costs``.
"""

from __future__ import annotations

from collections.abc import Sequence

from zeroc.passes.front.microbatch_shapes import MicrobatchGraph
from zeroc.passes.front.stage_units import find_blocks

__all__ = ["FLOPS_PER_BYTE", "assign_stages", "partition_costs"]

# A nominal machine balance: one byte moved costs about as much time as this many FLOPs.
FLOPS_PER_BYTE = 10


def partition_costs(costs: Sequence[float], parts: int) -> list[int]:
    """Start indices of ``parts`` contiguous, non-empty groups of ``costs`` (each >= 0) that
    minimise the largest group's sum; among equal cuts, each group starts as early as it can
    (the first minimiser of every step of the linear-partition dynamic program)."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} costs into {parts} non-empty groups")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the least largest sum of the first i costs in k groups; cut[k][i]: where
    # the k-th group starts.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        previous = best[k - 1]
        for i in range(k, n + 1):
            cut[k][i], best[k][i] = _best_start(previous, prefix, k - 1, i)
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def _best_start(previous: list[float], prefix: list[float], low: int,
                i: int) -> tuple[int, float]:
    """The first ``j`` in ``[low, i)`` minimising ``max(previous[j], prefix[i] - prefix[j])``
    and that value. ``previous`` does not decrease with ``j`` and ``prefix[i] - prefix[j]``
    does not increase (costs are >= 0), so the minimum sits where they cross: found by
    bisection, O(log n) instead of the O(n) scan."""
    lo, hi = low, i  # the first j where previous[j] >= prefix[i] - prefix[j]; i if none
    while lo < hi:
        mid = (lo + hi) // 2
        if previous[mid] >= prefix[i] - prefix[mid]:
            hi = mid
        else:
            lo = mid + 1
    cross = lo
    after = previous[cross] if cross < i else float("inf")  # max() is previous[] from cross
    if cross == low:
        return cross, after
    tail = prefix[i] - prefix[cross - 1]  # before cross max() is the tail, not increasing
    if after < tail:
        return cross, after
    lo, hi = low, cross - 1  # the first j whose tail is already that small
    while lo < hi:
        mid = (lo + hi) // 2
        if prefix[i] - prefix[mid] <= tail:
            hi = mid
        else:
            lo = mid + 1
    return lo, tail


def _node_cost(mgraph: MicrobatchGraph, name: str) -> float:
    estimate = mgraph.costs.get(name)
    return 0.0 if estimate is None else estimate.flops + FLOPS_PER_BYTE * estimate.bytes


def assign_stages(
    mgraph: MicrobatchGraph, num_stages: int, split_points: Sequence[str] | None = None
) -> tuple[dict[str, int], list[tuple[str, ...]], list[tuple[str, float]]]:
    """Stage of every batch-dependent node, the units of each stage, and each unit's cost."""
    # Anchored: traced in a module, or fed by such a node. Everything else reads only
    # placeholders (batch inputs, parameters, buffers) and is recomputed where it is used.
    layout = find_blocks([n for n in mgraph.gm.graph.nodes if n.name in mgraph.batch_dependent],
                         lambda n: _node_cost(mgraph, n.name))
    unit_of = layout.unit_of
    anchored: set[str] = set()
    for node in mgraph.gm.graph.nodes:
        if node.op in ("placeholder", "output") or node.name not in mgraph.batch_dependent:
            continue
        if unit_of(node) is not None or any(a.name in anchored for a in node.all_input_nodes):
            anchored.add(node.name)
    nodes = [n for n in mgraph.gm.graph.nodes if n.name in anchored]
    units: list[str] = []
    position: dict[str, int] = {}
    for node in nodes:
        unit = unit_of(node)
        if unit is not None:
            if unit not in units:
                units.append(unit)
            position[node.name] = units.index(unit)
        else:
            position[node.name] = max((position.get(a.name, 0) for a in node.all_input_nodes),
                                      default=0)
    unit_cost = [0.0] * len(units)
    for node in nodes:
        if units:
            unit_cost[position[node.name]] += _node_cost(mgraph, node.name)
    blocks = [i for i, u in enumerate(units) if layout.is_block(u)] or list(range(len(units)))
    if len(blocks) < num_stages:
        raise ValueError(
            f"zeroc pipeline: the model has {len(blocks)} layers "
            f"({', '.join(units[i] for i in blocks) or 'none'}) but {num_stages} pipeline stages "
            f"were asked for; every stage needs at least one layer: use at most {len(blocks)} "
            "stages or a deeper model"
        )
    if split_points is not None:
        starts = _pinned_starts(units, [units[i] for i in blocks], split_points, num_stages)
    else:
        # Segment i: block i plus the units up to the next block (and, for the first, before).
        segment = [0.0] * len(blocks)
        for u in range(len(units)):
            owner = max([i for i, b in enumerate(blocks) if b <= u], default=0)
            segment[owner] += unit_cost[u]
        starts = [0] + [blocks[i] for i in partition_costs(segment, num_stages)[1:]]
    stage_of_unit = [sum(1 for s in starts[1:] if s <= u) for u in range(len(units))]
    stage: dict[str, int] = {}
    for node in nodes:
        own = stage_of_unit[position[node.name]] if units else 0
        inputs = [stage[a.name] for a in node.all_input_nodes if a.name in stage]
        stage[node.name] = max([own, *inputs])
    members = [tuple(u for u, s in zip(units, stage_of_unit, strict=True) if s == k)
               for k in range(num_stages)]
    return stage, members, list(zip(units, unit_cost, strict=True))


def _pinned_starts(units: list[str], blocks: list[str], split_points: Sequence[str],
                   num_stages: int) -> list[int]:
    if len(split_points) != num_stages - 1:
        raise ValueError(
            f"zeroc pipeline: split_points={list(split_points)!r} names {len(split_points)} cut "
            f"points; {num_stages} stages need {num_stages - 1} (the first unit of stages 1.."
            f"{num_stages - 1})"
        )
    starts = [0]
    for name in split_points:
        if name not in blocks:
            raise ValueError(
                f"zeroc pipeline: split point {name!r} is not one of the model's blocks; give "
                f"the full dotted name of a block that starts a stage: {_shorten(blocks)}"
            )
        if units.index(name) <= starts[-1]:
            raise ValueError(
                f"zeroc pipeline: split_points={list(split_points)!r} must name modules in "
                "forward order, each after the previous one and after the first module"
            )
        starts.append(units.index(name))
    return starts


def _shorten(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} blocks)" if len(names) > limit else "")
