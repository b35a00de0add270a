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
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

import zeroc.runtime.zero_ops  # noqa: F401  (registers zeroc::unshard / reduce_grad)
from zeroc.passes.base import PassContext, PassResult
from zeroc.passes.node_builder import NodeBuilder
from zeroc.runtime.collectives import (
    ROWS_SUM_MEAN,
    collective_bytes,
    functional,
    reduce_scatter_runs_as_all_to_all,
)
from zeroc.runtime.plan.records import CollectiveInfo
from zeroc.runtime.quant.gather import BLOCK as QUANT_BLOCK
from zeroc.runtime.quant.gather import DEQUANTIZE_INT8, QUANTIZE_INT8, worth_quantizing
from zeroc.runtime.quant.reduce import (
    DEQUANTIZE_SUM_MEAN,
    QUANTIZE_GRAD_ROWS,
    REDUCE_BITS,
    residual_key,
)
from zeroc.runtime.quant.reduce import worth_quantizing as worth_reducing_quantized
from zeroc.runtime.secondary_shard import SECONDARY_SHARD, secondary_groups
from zeroc.runtime.zero_ops import WHOLE_FROM_SHARD, WHOLE_STAGES, group_size

aten = torch.ops.aten
prims = torch.ops.prims
UNSHARD = torch.ops.zeroc.unshard.default
REDUCE_GRAD = torch.ops.zeroc.reduce_grad.default
# Marks over a group of fewer ranks only reshape (a group of one moves nothing); the GPU check
# (benchmarks/gpu_checks/paths.py) sets 1 to run a world-1 group's collectives on one device.
COLLECTIVE_MIN_RANKS = 2


@dataclasses.dataclass
class _Bucket:
    key: tuple[str, int, torch.dtype]
    nodes: list[torch.fx.Node]
    nbytes: int


def _buckets(nodes: Sequence[torch.fx.Node], key: Callable[[torch.fx.Node], Any],
             size: Callable[[torch.fx.Node], int], cap: int,
             joinable: Callable[[_Bucket, torch.fx.Node], bool] = lambda b, n: True,
             ) -> list[_Bucket]:
    """Pack ``nodes`` in order into buckets of one key and at most ``cap`` bytes each.

    ``joinable(bucket, node)`` may refuse a node that cannot share the open bucket.
    """
    open_buckets: dict[Any, _Bucket] = {}
    done: list[_Bucket] = []
    for node in nodes:
        k = key(node)
        bucket = open_buckets.get(k)
        if bucket is not None and (bucket.nbytes + size(node) > cap
                                   or not joinable(bucket, node)):
            done.append(bucket)
            bucket = None
        if bucket is None:
            bucket = open_buckets[k] = _Bucket(k, [], 0)
        bucket.nodes.append(node)
        bucket.nbytes += size(node)
    done.extend(open_buckets.values())
    return sorted(done, key=lambda b: _order(b.nodes[0]))


def _order(node: torch.fx.Node) -> int:
    return node.meta["_zeroc_order"]


def gather_dtype(mark: torch.fx.Node) -> torch.dtype:
    """The dtype an unshard gathers in: its ``param_dtype`` argument, else the shard's."""
    param_dtype = mark.args[5] if len(mark.args) > 5 else mark.kwargs.get("param_dtype")
    return param_dtype or mark.args[0].meta["val"].dtype


# Reductions in flight at once: a bucket is waited before the next-but-one is issued, so the
# packed full-size gradients of at most this many buckets are alive together.
REDUCES_IN_FLIGHT = 2


def module_unit(name: str) -> str:
    """The module a parameter belongs to for bucketing: the first numbered block
    (``layers.3`` of ``layers.3.attn.qkv.weight``), else its top-level module (``tok_emb``).
    Buckets never mix units, so a ZeRO-3 gather holds one block at a time (as FSDP does)."""
    match = re.match(r"^(.*?\.\d+)(?:\.|$)", name)
    return match.group(1) if match else name.split(".")[0]


def _grad_param_names(gm: torch.fx.GraphModule, names: dict[str, str]) -> dict:
    """reduce_grad node -> parameter name: output ``i`` of a backward graph is the gradient
    of the forward's input ``primals_{i+1}``."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    found = {}
    for index, value in enumerate(output.args[0]):
        if isinstance(value, torch.fx.Node) and value.target is REDUCE_GRAD:
            key = f"primals_{index + 1}"
            found[value] = names.get(key, key)
    return found


def param_name(node: torch.fx.Node, names: dict[str, str]) -> str:
    """The parameter an unshard reads: its shard argument traced back to a placeholder."""
    source = node.args[0]
    while isinstance(source, torch.fx.Node) and source.op != "placeholder" and source.args:
        source = source.args[0]
    name = source.name if isinstance(source, torch.fx.Node) else str(source)
    return names.get(name, name)


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
             and group_size(n.args[3]) >= COLLECTIVE_MIN_RANKS]
    if not marks:
        return 0
    nodes = list(gm.graph.nodes)

    def first_use(node: torch.fx.Node) -> torch.fx.Node:
        return min(node.users, key=_order) if node.users else node

    for mark in marks:
        mark.meta["_zeroc_first_use"] = _order(first_use(mark))
    names = ctx.extras.get("input_names", {})
    buckets = _buckets(
        sorted(marks, key=lambda n: n.meta["_zeroc_first_use"]),
        key=lambda n: (n.args[3], n.args[4], gather_dtype(n),
                       module_unit(param_name(n, names))),
        size=lambda n: n.args[0].meta["val"].numel() * gather_dtype(n).itemsize
        * group_size(n.args[3]),
        cap=cap,
    )
    buckets.sort(key=lambda b: min(n.meta["_zeroc_first_use"] for n in b.nodes))
    build = NodeBuilder(gm)
    for index, bucket in enumerate(buckets):
        group_name = bucket.key[0]
        dp = group_size(group_name)
        need = nodes[min(n.meta["_zeroc_first_use"] for n in bucket.nodes)]
        early = buckets[max(0, index - prefetch)]
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
    return len(buckets)


def _merge_tied_reductions(gm: torch.fx.GraphModule) -> int:
    """``reduce_grad(a) + reduce_grad(b)`` -> ``reduce_grad(a + b)``: one reduction per tied
    parameter (an embedding shared with the head) instead of one per use. Exact: the
    reduction is linear."""
    build = NodeBuilder(gm)
    merged = 0
    for node in list(gm.graph.nodes):
        if node.target is not aten.add.Tensor or len(node.args) != 2:
            continue
        left, right = node.args
        if not all(isinstance(x, torch.fx.Node) and x.target is REDUCE_GRAD
                   and len(x.users) == 1 for x in (left, right)):
            continue
        if left.args[1:] != right.args[1:] or (
                left.args[0].meta["val"].shape != right.args[0].meta["val"].shape):
            continue
        with gm.graph.inserting_before(node):
            total = build.call(aten.add.Tensor, left.args[0], right.args[0])
            reduced = build.call(REDUCE_GRAD, total, *left.args[1:])
        node.replace_all_uses_with(reduced)
        for dead in (node, left, right):
            gm.graph.erase_node(dead)
        merged += 1
    return merged


def _lower_reduce_grads(gm: torch.fx.GraphModule, ctx: PassContext, cap: int) -> int:
    marks = [n for n in gm.graph.nodes if n.target is REDUCE_GRAD
             and group_size(n.args[2]) >= COLLECTIVE_MIN_RANKS]
    if not marks:
        return 0
    def first_user(node: torch.fx.Node) -> int:
        return min(_order(u) for u in node.users)

    # A bucket is reduced after its last gradient and waited before its first reader (the
    # output, or e.g. the sum of a tied parameter's two gradients): no member may be
    # produced after another member is read.
    names = ctx.extras.get("input_names", {})
    grad_names = _grad_param_names(gm, names)
    buckets = _buckets(
        marks,
        key=lambda n: (n.args[2], n.args[3], n.args[0].meta["val"].dtype,
                       module_unit(grad_names.get(n, ""))),
        size=lambda n: n.args[1] * n.args[0].meta["val"].element_size(),
        cap=cap,
        joinable=lambda b, n: _order(n) < min(first_user(m) for m in b.nodes),
    )
    nodes = list(gm.graph.nodes)
    build = NodeBuilder(gm)
    issued_buckets = []
    for bucket in buckets:
        group_name, stage = bucket.key[0], bucket.key[1]
        dp = group_size(group_name)
        by_all_to_all = stage >= 1 and reduce_scatter_runs_as_all_to_all(
            group_name, ctx.device, planned=ctx.planned is not None)
        bits = REDUCE_BITS.get(ctx.config.reduce_quant) if stage >= 1 else None
        if bits and not worth_reducing_quantized(sum(n.args[1] // dp for n in bucket.nodes),
                                                 bits, bucket.key[2], QUANT_BLOCK):
            bits = None  # too small to gain: reduced exact
        # Issued as soon as the bucket's last gradient exists.
        last = max(bucket.nodes, key=_order)
        if stage == 0:  # replicated: all-reduce the concatenated flat gradients
            widths = [n.args[0].meta["val"].numel() for n in bucket.nodes]
        else:  # sharded: rank-major rows, row r = every parameter's shard r
            widths = [n.args[1] // dp for n in bucket.nodes]
        with gm.graph.inserting_before(last.next):
            pieces = []
            for mark, width in zip(bucket.nodes, widths, strict=True):
                flat = build.call(aten.reshape.default, mark.args[0], [-1])
                if stage > 0:
                    pad = mark.args[1] - mark.args[0].meta["val"].numel()
                    if pad:
                        flat = build.call(aten.constant_pad_nd.default, flat, [0, pad], 0.0)
                    flat = build.call(aten.view.default, flat, [dp, width])
                pieces.append(flat)
            packed = pieces[0] if len(pieces) == 1 else build.call(
                aten.cat.default, pieces, 0 if stage == 0 else 1)
            packed = build.call(aten.reshape.default, packed, [-1])
            op = "reduce_scatter" if stage >= 1 else "all_reduce"
            if bits:  # reduce_quant: row r quantized (with error feedback) to rank r
                key = residual_key([grad_names.get(n, n.name) for n in bucket.nodes],
                                   ctx.extras.get("residuals"))
                packed = build.call(QUANTIZE_GRAD_ROWS, packed, dp, bits, QUANT_BLOCK, key)
                rows = [packed.meta["val"].numel() // dp] * dp
                issued = build.call(functional.all_to_all_single.default, packed, rows, rows,
                                    group_name)
            elif by_all_to_all:  # row r of the rank-major buffer to rank r
                rows = [packed.meta["val"].numel() // dp] * dp
                issued = build.call(functional.all_to_all_single.default, packed, rows, rows,
                                    group_name)
            elif stage >= 1:
                issued = build.call(functional.reduce_scatter_tensor.default, packed, "sum", dp,
                                    group_name)
            else:
                issued = build.call(functional.all_reduce.default, packed, "sum", group_name)
        issued_buckets.append((bucket, pieces[0], issued, packed, widths, last, op,
                               by_all_to_all, bits))
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for index, (bucket, _start, issued, packed, widths, last, op, by_all_to_all,
                bits) in enumerate(issued_buckets):
        group_name, stage = bucket.key[0], bucket.key[1]
        dp = group_size(group_name)
        # Waited before its first reader, or before the next-but-one bucket is packed.
        wait_at = nodes[min(first_user(m) for m in bucket.nodes)]
        if index + REDUCES_IN_FLIGHT < len(issued_buckets):
            later = issued_buckets[index + REDUCES_IN_FLIGHT][1]
            if position[issued] < position[later] < position[wait_at]:
                wait_at = later
        with gm.graph.inserting_before(wait_at):
            reduced = build.call(functional.wait_tensor.default, issued)
            if bits:  # every rank's row for this one, dequantized, summed in float32
                mean = build.call(DEQUANTIZE_SUM_MEAN, reduced, packed, dp, sum(widths), bits,
                                  QUANT_BLOCK, bucket.key[2])
            elif by_all_to_all:  # every rank's row for this one, summed and averaged; the
                # sent buffer lives until here, as the collective's work holds it
                mean = build.call(ROWS_SUM_MEAN, reduced, packed, dp)
            else:
                mean = build.call(aten.div.Tensor, reduced, dp)
            offset = 0
            for mark, width in zip(bucket.nodes, widths, strict=True):
                part = mean if len(widths) == 1 else build.call(
                    aten.slice.Tensor, mean, 0, offset, offset + width)
                offset += width
                if stage == 1:  # whole parameters: the rows in a whole-size gradient
                    part = build.call(WHOLE_FROM_SHARD, part,
                                      mark.args[0].meta["val"].numel(), group_name)
                mark.replace_all_uses_with(part)
                gm.graph.erase_node(mark)
        in_bytes = packed.meta["val"].numel() * packed.meta["val"].element_size()
        ctx.collectives.append(CollectiveInfo(
            name=f"{ctx.graph_name}.reduce{index}", graph=ctx.graph_name, op=op,
            group=group_name, params=tuple(grad_names.get(n, n.name) for n in bucket.nodes),
            bytes=collective_bytes(op, in_bytes, 0),
            issued_at=last.name, waited_at=wait_at.name,
            dtype=ctx.config.reduce_quant if bits else str(bucket.key[2]).removeprefix(
                "torch.")))
    return len(buckets)


def _lower_whole_unshards(gm: torch.fx.GraphModule) -> int:
    """Stages 0 and 1 (or a group of one) keep whole flat parameters: unshard is a view, no
    copy."""
    build = NodeBuilder(gm)
    lowered = 0
    for mark in [n for n in gm.graph.nodes if n.target is UNSHARD]:
        if mark.args[4] not in WHOLE_STAGES and group_size(mark.args[3]) >= COLLECTIVE_MIN_RANKS:
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
    tied = _merge_tied_reductions(gm)
    for order, node in enumerate(gm.graph.nodes):
        node.meta["_zeroc_order"] = order
    cap = max(1, int(ctx.config.bucket_mb * 2**20))
    gathers = _lower_unshards(gm, ctx, cap, ctx.config.prefetch)
    for order, node in enumerate(gm.graph.nodes):
        node.meta["_zeroc_order"] = order
    reduces = _lower_reduce_grads(gm, ctx, cap)
    for node in gm.graph.nodes:
        node.meta.pop("_zeroc_order", None)
        node.meta.pop("_zeroc_first_use", None)
    stats = {"gather_buckets": gathers, "reduce_buckets": reduces, "whole_params": views,
             "tied_merged": tied}
    if folded:
        stats["secondary_folded"] = folded
    return PassResult(gm, bool(gathers or reduces or views or tied or folded), stats)
