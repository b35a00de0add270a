"""ZeRO lowering: ``zeroc.unshard`` / ``zeroc.reduce_grad`` markers -> bucketed collectives.

Runs on the forward and backward graphs after partitioning. Markers of one data-parallel
group, ZeRO stage and dtype are packed in order of use into buckets of at most
``config.bucket_mb`` MiB:

- unshard buckets: the shards are gathered by one ``all_gather_into_tensor_coalesced`` (one
  ``all_gather_into_tensor`` for a bucket of one) whose output for each shard is its
  parameter's padded flat buffer, viewed in place as the parameter (no copy out of a packed
  buffer). The gather is issued where bucket ``k - prefetch`` is first needed
  (``config.prefetch``) and waited right before bucket ``k`` is first needed, so the
  transfer overlaps the compute in between; every gathered tensor dies after its last use.
- reduce_grad buckets: the padded gradients are laid out rank-major, then one
  ``reduce_scatter_tensor`` (stages 1, 2, 3) or ``all_reduce`` (stage 0) is issued as soon
  as the bucket's last gradient exists, and waited before its first reader. The sum is
  divided by the group size (mean over ranks). On gloo, whose reduce-scatter is an
  all-reduce plus a copy of the chunk (twice the bytes), stages 1-3 send row r of the
  rank-major bucket to rank r (``all_to_all_single``) and sum the rows received, then divide
  (``zeroc::rows_sum_mean``, ``zeroc.runtime.collectives``). Stage 1's parameters are whole,
  so each gradient's reduced rows are put back in a whole-size gradient
  (``zeroc::whole_from_shard``), of which ``zeroc.sharding.sharded_params`` keeps the rows.
- Mixed precision: an unshard's ``param_dtype`` is applied to the shard right before the
  gather (half the traffic in bf16); the backward's cast to ``reduce_dtype`` is already in
  the graph before ``reduce_grad``.
- ``gather_quant="int8"``: a bucket's shards are quantized together where its gather is
  issued (``zeroc::quantize_int8``, the send buffer), one all-gather moves the packed int8
  blocks and scales, and ``zeroc::dequantize_int8`` writes every parameter's padded flat
  buffer in the gather dtype right after the wait (``zeroc.runtime.quant.gather``); a
  bucket too small to gain is gathered exact.
- ``reduce_quant="int8" | "int4"`` (stages 1-3): the rank-major bucket is quantized row by row
  with error feedback (``zeroc::quantize_grad_rows``), row r goes to rank r by one
  ``all_to_all_single`` (on every backend), and ``zeroc::dequantize_sum_mean`` sums the
  received rows in float32 and averages them (``zeroc.runtime.quant.reduce``); the residual is
  the bucket's parameters' in its model's store (``ctx.extras["residuals"]``).
- hpZ (``secondary_shard=k``, ``zeroc.passes.secondary_shard``): a forward's
  ``unshard(secondary_shard(w))`` is folded to ``w``; the backward's gathers of the secondary
  pieces run over their group of ``k`` ranks like any gather, bucketed by group, and are never
  quantized (they stay inside the node).

Each bucket is published to ``ctx.collectives`` (parameters, bytes, issue and wait points).
The gradient side is ``zeroc.passes.zero_reductions``; buckets and names are
``zeroc.passes.zero_buckets``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from zeroc.passes import zero_buckets
from zeroc.passes.base import PassContext, PassResult
from zeroc.passes.node_builder import NodeBuilder
from zeroc.passes.zero_buckets import (
    ORDER,
    UNSHARD,
    aten,
    buckets,
    gather_dtype,
    module_unit,
    order,
    param_name,
    prims,
)
from zeroc.passes.zero_reductions import lower_reduce_grads, merge_tied_reductions
from zeroc.runtime.collectives import collective_bytes, functional
from zeroc.runtime.plan.records import CollectiveInfo
from zeroc.runtime.quant.gather import BLOCK as QUANT_BLOCK
from zeroc.runtime.quant.gather import DEQUANTIZE_INT8, QUANTIZE_INT8, worth_quantizing
from zeroc.runtime.secondary_shard import SECONDARY_SHARD, secondary_groups
from zeroc.runtime.zero_ops import WHOLE_STAGES, group_size

__all__ = ["lower_zero"]


def _hoist(node: torch.fx.Node, before: torch.fx.Node, position: dict) -> None:
    """Move ``node`` (and what it reads, recursively) in front of ``before`` if it is later.

    Only pure computations of graph inputs are moved; ``position`` is updated to match.
    """
    if position[node] < position[before]:
        return
    if node.op != "call_function" or node.is_impure():
        raise AssertionError(f"cannot issue a gather before {node.name}, which it reads")
    for arg in node.all_input_nodes:
        _hoist(arg, before, position)
    before.prepend(node)
    position[node] = position[before] - 0.5


def _lower_unshards(gm: torch.fx.GraphModule, ctx: PassContext, cap: int,
                    prefetch: int) -> int:
    # Stages 0 and 1 keep whole parameters: their unshard only reshapes, nothing to gather.
    marks = [n for n in gm.graph.nodes if n.target is UNSHARD
             and n.args[4] not in WHOLE_STAGES
             and group_size(n.args[3]) >= zero_buckets.COLLECTIVE_MIN_RANKS]
    if not marks:
        return 0
    nodes = list(gm.graph.nodes)

    def first_use(node: torch.fx.Node) -> torch.fx.Node:
        return min(node.users, key=order) if node.users else node

    for mark in marks:
        mark.meta["_zeroc_first_use"] = order(first_use(mark))
    names = ctx.extras.get("input_names", {})
    packed_buckets = buckets(
        sorted(marks, key=lambda n: n.meta["_zeroc_first_use"]),
        key=lambda n: (n.args[3], n.args[4], gather_dtype(n),
                       module_unit(param_name(n, names))),
        size=lambda n: n.args[0].meta["val"].numel() * gather_dtype(n).itemsize
        * group_size(n.args[3]),
        cap=cap,
    )
    packed_buckets.sort(key=lambda b: min(n.meta["_zeroc_first_use"] for n in b.nodes))
    build = NodeBuilder(gm)
    for index, bucket in enumerate(packed_buckets):
        group_name = bucket.key[0]
        dp = group_size(group_name)
        need = nodes[min(n.meta["_zeroc_first_use"] for n in bucket.nodes)]
        early = packed_buckets[max(0, index - prefetch)]
        issue_at = nodes[min(n.meta["_zeroc_first_use"] for n in early.nodes)]
        shards = [n.args[0] for n in bucket.nodes]
        # Named before the marks are erased below.
        bucket_params = tuple(param_name(n, names) for n in bucket.nodes)
        # The shards must exist where the gather is issued: hoist what computes them from
        # the inputs (e.g. the bf16 cast of a shard) up to the issue point.
        position = {n: i for i, n in enumerate(gm.graph.nodes)}
        for shard in shards:
            _hoist(shard, issue_at, position)
        # hpZ's node-local re-gathers stay exact: they never cross the slow link.
        quantized = ctx.config.gather_quant == "int8" and group_name not in (
            secondary_groups()) and worth_quantizing(
            sum(s.meta["val"].numel() for s in shards), bucket.key[2])
        with gm.graph.inserting_before(issue_at):
            if quantized:  # the bucket as int8 blocks + scales, from the exact shards
                widths = [s.meta["val"].numel() for s in shards]
                shards = [build.call(QUANTIZE_INT8, shards, QUANT_BLOCK)]
            else:  # mixed precision: cast each shard to the gather dtype where it is issued
                shards = [s if s.meta["val"].dtype == bucket.key[2] else
                          build.call(prims.convert_element_type.default, s, bucket.key[2])
                          for s in shards]
            if len(shards) == 1:
                issued = [build.call(functional.all_gather_into_tensor.default, shards[0], dp,
                                     group_name)]
            else:
                # One collective, one output per shard: each output is its parameter's padded
                # flat buffer (rank-major), so nothing is copied out of a packed buffer.
                outputs = build.call(functional.all_gather_into_tensor_coalesced.default,
                                     shards, dp, group_name)
                issued = [build.call(operator.getitem, outputs, i) for i in range(len(shards))]
        with gm.graph.inserting_before(need):
            if quantized:  # every parameter's padded flat buffer, one after another
                joined = build.call(DEQUANTIZE_INT8, build.call(
                    functional.wait_tensor.default, issued[0]), widths, QUANT_BLOCK,
                    bucket.key[2])
                starts = [dp * sum(widths[:i]) for i in range(len(widths) + 1)]
                issued = [(aten.slice.Tensor, joined, 0, lo, hi)
                          for lo, hi in zip(starts, starts[1:], strict=False)]
            else:
                issued = [(functional.wait_tensor.default, out) for out in issued]
            for mark, (target, *args) in zip(bucket.nodes, issued, strict=True):
                flat_param = build.call(target, *args)
                numel, shape = mark.args[2], list(mark.args[1])
                if numel != flat_param.meta["val"].numel():
                    flat_param = build.call(aten.slice.Tensor, flat_param, 0, 0, numel)
                param = build.call(aten.view.default, flat_param, shape)
                mark.replace_all_uses_with(param)
                gm.graph.erase_node(mark)
        moved = sum(s.meta["val"].numel() * s.meta["val"].element_size() for s in shards) * dp
        ctx.collectives.append(CollectiveInfo(
            name=f"{ctx.graph_name}.gather{index}", graph=ctx.graph_name, op="all_gather",
            group=group_name, params=bucket_params,
            bytes=collective_bytes("all_gather", 0, moved),
            issued_at=issue_at.name, waited_at=need.name,
            dtype="int8" if quantized else str(bucket.key[2]).removeprefix("torch.")))
    return len(packed_buckets)


def _lower_whole_unshards(gm: torch.fx.GraphModule) -> int:
    """Stages 0 and 1 (or a group of one) keep whole flat parameters: unshard is a view, no
    copy."""
    build = NodeBuilder(gm)
    lowered = 0
    for mark in [n for n in gm.graph.nodes if n.target is UNSHARD]:
        gathered = group_size(mark.args[3]) >= zero_buckets.COLLECTIVE_MIN_RANKS
        if mark.args[4] not in WHOLE_STAGES and gathered:
            continue
        shard, shape, numel = mark.args[0], list(mark.args[1]), mark.args[2]
        with gm.graph.inserting_before(mark):
            flat = shard
            if shard.meta["val"].numel() != numel:
                flat = build.call(aten.slice.Tensor, shard, 0, 0, numel)
            param = build.call(aten.view.default, flat, shape)
            if gather_dtype(mark) != shard.meta["val"].dtype:
                param = build.call(prims.convert_element_type.default, param,
                                   gather_dtype(mark))
        mark.replace_all_uses_with(param)
        gm.graph.erase_node(mark)
        lowered += 1
    return lowered


def _fold_secondary_regathers(gm: torch.fx.GraphModule) -> int:
    """hpZ (``zeroc.passes.secondary_shard``): where a weight's secondary piece and its
    re-gather are in one graph (the forward), the re-gather is the weight the piece was cut
    from; read it instead of gathering it back."""
    folded = 0
    for node in list(gm.graph.nodes):
        piece = node.args[0] if node.target is UNSHARD else None
        if isinstance(piece, torch.fx.Node) and piece.target is SECONDARY_SHARD:
            node.replace_all_uses_with(piece.args[0])
            gm.graph.erase_node(node)
            folded += 1
    return folded


def lower_zero(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace ZeRO markers with bucketed, prefetched functional collectives."""
    folded = _fold_secondary_regathers(gm)
    views = _lower_whole_unshards(gm)
    tied = merge_tied_reductions(gm)
    for index, node in enumerate(gm.graph.nodes):
        node.meta[ORDER] = index
    cap = max(1, int(ctx.config.bucket_mb * 2**20))
    gathers = _lower_unshards(gm, ctx, cap, ctx.config.prefetch)
    for index, node in enumerate(gm.graph.nodes):
        node.meta[ORDER] = index
    reduces = lower_reduce_grads(gm, ctx, cap)
    for node in gm.graph.nodes:
        node.meta.pop(ORDER, None)
        node.meta.pop("_zeroc_first_use", None)
    stats = {"gather_buckets": gathers, "reduce_buckets": reduces, "whole_params": views,
             "tied_merged": tied}
    if folded:
        stats["secondary_folded"] = folded
    return PassResult(gm, bool(gathers or reduces or views or tied or folded), stats)
