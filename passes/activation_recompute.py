"""Tag cheap ops in the joint graph so the backward recomputes their outputs instead of saving.

An MLP ``proj(gelu(fc(x)))`` needs two tensors of the hidden width in its backward: ``fc(x)``
(for ``gelu_backward``) and ``gelu(fc(x))`` (for the weight gradient of ``proj``). The first
must be saved anyway, and the second is one pointwise op away from it, yet the min-cut
partitioner saves both: it will not recompute a value that the backward has to materialize for
a matrix product. Saving one instead of two halves the MLP's activation memory (a quarter of
a transformer block's) for the price of one pointwise op per block in the backward.

Layer norm is the same case: its input is saved for its own backward, and its output is saved
again for the weight gradient of the projection that reads it.

The rule, for each cheap op (a unary activation such as GELU, SiLU, tanh, sigmoid; layer norm)
in the forward part of the joint graph: if every tensor it reads is available to the backward
anyway (read by the backward, a graph input, or itself recomputed) and its output is read by
the backward, tag the op ``MUST_RECOMPUTE``. An op whose input the backward does not read (ReLU,
whose backward reads its output) is left alone: recomputing it would save its input instead,
which gains nothing.

Runs only with ``partitioner="min_cut"`` (the default partitioner ignores the tags), and as
the ``activation_recompute`` option says: ``"auto"`` tags where a recomputed op fuses into the
backward's kernels (graphs compiled by Inductor or launched as zeroc's Triton kernels) and not
on the aten path, where every recomputed op is one more pass over its tensor: on a CPU
pipeline stage that pass lengthened each backward that the neighbouring ranks wait for (the
8-block GPT's pipeline step went from 1.13x torch's to 1.01-1.03x without it).
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from zeroc.codegen.inductor_graphs import kernel_path
from zeroc.passes.base import PassContext, PassResult
from zeroc.runtime.cost import tensor_bytes

aten = torch.ops.aten

# Ops that cost about as much as a copy of their output: unary activations and layer norm.
CHEAP_OPS = {
    aten.gelu.default, aten.silu.default, aten.tanh.default, aten.sigmoid.default,
    aten.mish.default, aten.hardswish.default, aten.elu.default, aten.softplus.default,
    aten.native_layer_norm.default,
}

# Any id distinct from other tagged regions (see passes/zero_recompute.py).
ACTIVATION_AC_GRAPH_ID = 100_001


def backward_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Nodes of the joint graph that depend on a ``tangents_*`` input (the backward part)."""
    found: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                found.add(node)
        elif any(arg in found for arg in node.all_input_nodes):
            found.add(node)
    return found


def _read_by(node: torch.fx.Node, readers: set[torch.fx.Node]) -> bool:
    """Whether a node in ``readers`` uses ``node`` directly or through views of it."""
    for user in node.users:
        if user in readers:
            return True
        if user.op == "call_function" and getattr(user.target, "is_view", False) \
                and _read_by(user, readers):
            return True
    return False


def _available_to_backward(node: torch.fx.Node, backward: set[torch.fx.Node]) -> bool:
    """Whether the backward has ``node`` without saving it for this op's sake."""
    if node.op == "placeholder":
        return True
    if node.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE:
        return True
    if node.op == "call_function" and getattr(node.target, "is_view", False):
        source = node.args[0]
        return isinstance(source, torch.fx.Node) and _available_to_backward(source, backward)
    return _read_by(node, backward)


def _output_read_by(node: torch.fx.Node, backward: set[torch.fx.Node]) -> bool:
    """Whether the backward reads the op's (first) output, looking through ``getitem``."""
    if isinstance(node.meta.get("val"), (tuple, list)):
        return any(user.target is operator.getitem and user.args[1] == 0
                   and _read_by(user, backward) for user in node.users)
    return _read_by(node, backward)


def recompute_disabled(config: object, device: torch.device) -> str | None:
    """Why ``config`` turns activation recompute off on ``device``; ``None`` when it is on."""
    if getattr(config, "partitioner", "min_cut") != "min_cut":
        return "partitioner is not min_cut"
    setting = getattr(config, "activation_recompute", "auto")
    if setting is False:
        return "activation_recompute=False"
    if setting == "auto" and kernel_path(getattr(config, "kernels", "auto"), device) == "aten":
        return "activation_recompute='auto' on the aten path (a recomputed op would not fuse)"
    return None


def tag_activation_recompute(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Tag each cheap op whose inputs the backward has anyway ``MUST_RECOMPUTE``."""
    disabled = recompute_disabled(ctx.config, ctx.device)
    if disabled is not None:
        return PassResult(gm, False, {"disabled": disabled})
    backward = backward_nodes(gm)
    tagged = saved_bytes = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in CHEAP_OPS:
            continue
        if node in backward or "recompute" in node.meta:
            continue
        if not all(_available_to_backward(arg, backward) for arg in node.all_input_nodes):
            continue
        if not _output_read_by(node, backward):
            continue
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = ACTIVATION_AC_GRAPH_ID
        tagged += 1
        value = node.meta.get("val")
        saved_bytes += tensor_bytes(value[0] if isinstance(value, (tuple, list)) else value)
    return PassResult(gm, tagged > 0, {"tagged": tagged, "bytes_not_saved": saved_bytes})
