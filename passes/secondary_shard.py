"""hpZ on the joint graph: the backward re-gathers ZeRO-3 weights inside groups of k ranks.

With ``options={"secondary_shard": k}`` every ZeRO-3 gather tagged ``MUST_RECOMPUTE``
(``zeroc.passes.zero_recompute``), ``w = unshard(shard, dp group)``, becomes

    w     = unshard(shard, dp group)          # the forward's gather (MUST_RECOMPUTE)
    piece = secondary_shard(w, padded, node)  # 1/k of w, this rank's (MUST_SAVE)
    w'    = unshard(piece, node)              # every reader of w reads w' (MUST_RECOMPUTE)

so the partitioner saves ``piece`` and the backward, which may not keep ``w``, re-gathers
``w'`` from the pieces of its group of ``k`` ranks (``zeroc.runtime.secondary_shard``): every
backward reader, and every forward op the partitioner recomputes in the backward, reads the
node-local gather. In the forward ``unshard(secondary_shard(w))`` is ``w`` itself (the
group's pieces of one weight put back together): ``zeroc.passes.zero`` folds it there, so
the forward moves nothing more than ZeRO-3 does. The gradient is untouched: it is the
joint graph's own reduction of ``w``'s gradient over the data-parallel group.

The pieces' names are added to the graph's input names (their parameter's name), so the
backward's gathers bucket and read as their parameters'.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from zeroc.passes.base import PassContext, PassResult
from zeroc.passes.node_builder import NodeBuilder
from zeroc.passes.zero_buckets import param_name
from zeroc.passes.zero_recompute import ZERO_AC_GRAPH_ID
from zeroc.runtime.secondary_shard import (
    SECONDARY_SHARD,
    secondary_group,
    secondary_padded_numel,
)
from zeroc.runtime.zero_ops import group_size

UNSHARD = torch.ops.zeroc.unshard.default


def _tag(node: torch.fx.Node, policy: CheckpointPolicy) -> None:
    node.meta["recompute"] = policy
    node.meta["ac_graph_id"] = ZERO_AC_GRAPH_ID


def cut_secondary_shards(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Give every re-gathered ZeRO-3 weight a secondary piece the backward gathers from."""
    k = ctx.config.secondary_shard
    if not k:
        return PassResult(gm, False, {"disabled": "secondary_shard=None"})
    names: dict[str, str] = ctx.extras.get("input_names", {})
    build = NodeBuilder(gm)
    cut = 0
    for node in list(gm.graph.nodes):
        if (node.target is not UNSHARD or node.args[4] != 3 or group_size(node.args[3]) <= 1
                or node.meta.get("recompute") != CheckpointPolicy.MUST_RECOMPUTE):
            continue
        group = secondary_group(node.args[3], k)
        shape, numel = list(node.args[1]), node.args[2]
        readers = list(node.users)
        with gm.graph.inserting_after(node):
            piece = build.call(SECONDARY_SHARD, node, secondary_padded_numel(shape, k), group)
        with gm.graph.inserting_after(piece):
            regathered = build.call(UNSHARD, piece, shape, numel, group, 3)
        for reader in readers:
            reader.replace_input_with(node, regathered)
        _tag(piece, CheckpointPolicy.MUST_SAVE)
        _tag(regathered, CheckpointPolicy.MUST_RECOMPUTE)
        if "input_names" in ctx.extras:
            names[piece.name] = param_name(node, names)
        cut += 1
    return PassResult(gm, cut > 0, {"secondary_pieces": cut})


def keep_read_secondary_shards(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Drop the pieces the backward never reads (``ctx.extras["backward"]``: the backward
    graph of a trial partition of ``gm``): the backward of an embedding, a bias or a norm's
    weight does not read the weight, and its piece would only cost memory."""
    backward = ctx.extras["backward"]
    read = {node.name for node in backward.graph.find_nodes(op="placeholder")
            if any(user.target is UNSHARD for user in node.users)}
    names: dict[str, str] = ctx.extras.get("input_names", {})
    dropped = 0
    for piece in list(gm.graph.find_nodes(op="call_function", target=SECONDARY_SHARD)):
        if piece.name in read:
            continue
        for regathered in list(piece.users):
            regathered.replace_all_uses_with(piece.args[0])
            gm.graph.erase_node(regathered)
        gm.graph.erase_node(piece)
        names.pop(piece.name, None)
        dropped += 1
    return PassResult(gm, dropped > 0, {"unread_pieces_dropped": dropped})
