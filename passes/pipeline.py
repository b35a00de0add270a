"""The literal pass pipelines, in the order they run.

Each entry is a function ``(gm, ctx) -> PassResult`` from its own file. ``run_passes`` in
``base.py`` lints the graph and records it before and after every pass.
"""

from __future__ import annotations

from zeroc.passes.activation_recompute import tag_activation_recompute
from zeroc.passes.dead_code import eliminate_dead_code
from zeroc.passes.front.hoist_unshard import hoist_unshards
from zeroc.passes.front.loss_normalization import normalize_loss
from zeroc.passes.front.loss_output import keep_loss_output
from zeroc.passes.front.microbatch_shapes import microbatch_graph
from zeroc.passes.front.specialize_shapes import specialize, specialize_outputs
from zeroc.passes.front.split_stages import split_stages
from zeroc.passes.fusion import fusion
from zeroc.passes.linear_cross_entropy import fuse_linear_cross_entropy
from zeroc.passes.noop_views import remove_noop_views
from zeroc.passes.secondary_shard import cut_secondary_shards
from zeroc.passes.zero import lower_zero
from zeroc.passes.zero_recompute import tag_zero_recompute

# On the Dynamo graph (torch-level ops), before AOTAutograd traces it.
DYNAMO_PASSES = (
    fuse_linear_cross_entropy,
)

# The pipeline front (``zeroc.pipeline.pipeline_front``, with a
# ``zeroc.passes.front.context.FrontContext``), on the Dynamo graph of a pipelined model, in
# this order: a dynamic graph made static at the call's (or one micro-batch's) sizes,
SPECIALIZE_PASSES = (
    specialize,
)
# or, while a world is planned, a copy that is never run (its outputs' shapes only);
SPECIALIZE_OUTPUTS_PASSES = (
    specialize_outputs,
)
# the loss kept as the only output; then DYNAMO_PASSES;
LOSS_PASSES = (
    keep_loss_output,
)
# the loss as a sum over the micro-batch (its normaliser published beside it);
NORMALIZE_PASSES = (
    normalize_loss,
)
# on the graph whose stages are compiled: ZeRO gathers taken out (once per step),
HOIST_PASSES = (
    hoist_unshards,
)
# then the graph at the micro-batch size, cut into stages.
STAGE_PASSES = (
    microbatch_graph,
    split_stages,
)

# On the joint forward+backward graph, before it is partitioned.
JOINT_PASSES = (
    tag_zero_recompute,
    cut_secondary_shards,
    tag_activation_recompute,
)

# On each functional graph (forward, backward or inference) after partitioning.
GRAPH_PASSES = (
    lower_zero,
    remove_noop_views,
    eliminate_dead_code,
    fusion,
)


def graph_passes(kernel_path: str) -> tuple:
    """``GRAPH_PASSES`` for graphs compiled by ``kernel_path`` (see
    ``zeroc.codegen.inductor_graphs.kernel_path``): Inductor fuses by itself, so its graphs
    skip zeroc's fusion pass."""
    if kernel_path == "inductor":
        return tuple(p for p in GRAPH_PASSES if p is not fusion)
    return GRAPH_PASSES
