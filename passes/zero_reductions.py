"""The ZeRO pass's gradient side: ``zeroc.reduce_grad`` marks -> bucketed reductions.

Called by ``zeroc.passes.zero.lower_zero`` (whose docstring describes the buckets, the
all-to-all form on gloo, quantized reductions and mixed precision). A tied parameter's
gradients are summed before one reduction (``merge_tied_reductions``); every bucket is issued
after its last gradient and waited before its first reader, with at most
``REDUCES_IN_FLIGHT`` buckets' packed gradients alive at once.
"""

from __future__ import annotations

import torch
import torch.fx

from zeroc.passes import zero_buckets
from zeroc.passes.base import PassContext
from zeroc.passes.node_builder import NodeBuilder
from zeroc.passes.zero_buckets import (
    REDUCE_GRAD,
    aten,
    buckets,
    grad_param_names,
    module_unit,
    order,
)
from zeroc.runtime.collectives import (
    ROWS_SUM_MEAN,
    collective_bytes,
    functional,
    reduce_scatter_runs_as_all_to_all,
)
from zeroc.runtime.plan.records import CollectiveInfo
from zeroc.runtime.quant.gather import BLOCK as QUANT_BLOCK
from zeroc.runtime.quant.reduce import (
    DEQUANTIZE_SUM_MEAN,
    QUANTIZE_GRAD_ROWS,
    REDUCE_BITS,
    residual_key,
)
from zeroc.runtime.quant.reduce import worth_quantizing as worth_reducing_quantized
from zeroc.runtime.zero_ops import WHOLE_FROM_SHARD, group_size

# Reductions in flight at once: a bucket is waited before the next-but-one is issued, so the
# packed full-size gradients of at most this many buckets are alive together.
REDUCES_IN_FLIGHT = 2


def merge_tied_reductions(gm: torch.fx.GraphModule) -> int:
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


def lower_reduce_grads(gm: torch.fx.GraphModule, ctx: PassContext, cap: int) -> int:
    """Replace ``reduce_grad`` marks by bucketed reductions (see ``zeroc.passes.zero``);
    return how many buckets."""
    marks = [n for n in gm.graph.nodes if n.target is REDUCE_GRAD
             and group_size(n.args[2]) >= zero_buckets.COLLECTIVE_MIN_RANKS]
    if not marks:
        return 0
    def first_user(node: torch.fx.Node) -> int:
        return min(order(u) for u in node.users)

    # A bucket is reduced after its last gradient and waited before its first reader (the
    # output, or e.g. the sum of a tied parameter's two gradients): no member may be
    # produced after another member is read.
    names = ctx.extras.get("input_names", {})
    grad_names = grad_param_names(gm, names)
    packed_buckets = buckets(
        marks,
        key=lambda n: (n.args[2], n.args[3], n.args[0].meta["val"].dtype,
                       module_unit(grad_names.get(n, ""))),
        size=lambda n: n.args[1] * n.args[0].meta["val"].element_size(),
        cap=cap,
        joinable=lambda b, n: order(n) < min(first_user(m) for m in b.nodes),
    )
    nodes = list(gm.graph.nodes)
    build = NodeBuilder(gm)
    issued_buckets = []
    for bucket in packed_buckets:
        group_name, stage = bucket.key[0], bucket.key[1]
        dp = group_size(group_name)
        by_all_to_all = stage >= 1 and reduce_scatter_runs_as_all_to_all(
            group_name, ctx.device, planned=ctx.planned is not None)
        bits = REDUCE_BITS.get(ctx.config.reduce_quant) if stage >= 1 else None
        if bits and not worth_reducing_quantized(sum(n.args[1] // dp for n in bucket.nodes),
                                                 bits, bucket.key[2], QUANT_BLOCK):
            bits = None  # too small to gain: reduced exact
        # Issued as soon as the bucket's last gradient exists.
        last = max(bucket.nodes, key=order)
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
    return len(packed_buckets)
