"""Tag ZeRO gathers in the joint graph so the partitioner saves or re-gathers them.

ZeRO-3 must not keep gathered parameters from the forward to the backward: every
``zeroc.unshard`` is tagged ``MUST_RECOMPUTE`` (the selective-checkpoint policy the min-cut
partitioner honours), so the forward saves only the shards and the backward gathers again.
Stages 1 and 2 keep the gathered parameters (``MUST_SAVE``): one gather per step.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from zeroc.passes.base import PassContext, PassResult
from zeroc.runtime.zero_ops import WHOLE_STAGES  # (registers zeroc::unshard)

UNSHARD = torch.ops.zeroc.unshard.default

# Any id works: the partitioner only groups tagged nodes of one checkpointed region.
ZERO_AC_GRAPH_ID = 100_000


def tag_zero_recompute(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Set the recompute policy of every sharded parameter's gather."""
    tagged = 0
    for node in gm.graph.nodes:
        if node.target is not UNSHARD or node.args[4] in WHOLE_STAGES:  # whole: no gather
            continue
        stage = node.args[4]
        policy = CheckpointPolicy.MUST_RECOMPUTE if stage == 3 else CheckpointPolicy.MUST_SAVE
        node.meta["recompute"] = policy
        node.meta["ac_graph_id"] = ZERO_AC_GRAPH_ID
        tagged += 1
    return PassResult(gm, tagged > 0, {"tagged": tagged})
