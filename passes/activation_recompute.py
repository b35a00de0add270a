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

On the Inductor path the joint graph is traced with Inductor's decompositions, so GELU is a
chain of ``mul``/``erf``/``add`` and layer norm ``var_mean`` followed by pointwise ops: no
node is one of the cheap ops above. There the same rule applies to short pointwise chains: a
pointwise node whose output the backward reads is tagged, with the pointwise nodes between it
and tensors the backward has anyway (at most ``MAX_CHAIN`` of them), which Inductor fuses into
one recomputing kernel of the backward. A chain that reads a ZeRO-gathered weight (a norm's
affine scale) is left alone: recomputing it would move the gather's use into the backward.

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
from zeroc.runtime.cost.cost import tensor_bytes
from zeroc.runtime.torch_compat import OpOverload

aten = torch.ops.aten

# Ops that cost about as much as a copy of their output: unary activations and layer norm.
CHEAP_OPS = {
    aten.gelu.default, aten.silu.default, aten.tanh.default, aten.sigmoid.default,
    aten.mish.default, aten.hardswish.default, aten.elu.default, aten.softplus.default,
    aten.native_layer_norm.default,
}

# The longest pointwise chain recomputed on the Inductor path (decomposed GELU: 5 nodes;
# layer norm's affine tail after var_mean: 4).
MAX_CHAIN = 8

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


def backward_side(gm: torch.fx.GraphModule, backward: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """Nodes the forward's own outputs do not need: the backward and what only it reads
    (decomposed backwards compute values such as ``x * x`` from forward tensors alone)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    needed: set[torch.fx.Node] = set()
    work = [a for a in output.all_input_nodes if a not in backward]
    while work:
        node = work.pop()
        if node not in needed:
            needed.add(node)
            work.extend(node.all_input_nodes)
    return {n for n in gm.graph.nodes if n.op == "call_function" and n not in needed}


def _pointwise(node: torch.fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, OpOverload)
            and torch.Tag.pointwise in target.tags and not target._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in target.tags)


def _gathered(node: torch.fx.Node) -> bool:
    """Whether ``node`` is (a view of) a value a collective produced: a ZeRO-gathered
    weight, whose lifetime zeroc's placement of gathers decides."""
    while node.op == "call_function" and getattr(node.target, "is_view", False):
        node = node.args[0]
    target = node.target
    if target is torch.ops._c10d_functional.wait_tensor.default:
        return True
    namespace = getattr(target, "namespace", None)
    return namespace in ("zeroc", "_c10d_functional", "c10d_functional")


def _chain(node: torch.fx.Node, backward: set[torch.fx.Node]) -> list[torch.fx.Node] | None:
    """``node`` and the forward pointwise nodes it reads back to tensors the backward has
    anyway, if there are at most ``MAX_CHAIN`` of them; else ``None``."""
    chain, work = [node], list(node.all_input_nodes)
    while work:
        arg = work.pop()
        if _gathered(arg):
            return None  # recomputing it would keep a ZeRO gather alive into the backward
        if arg in chain or _available_to_backward(arg, backward):
            continue
        if arg in backward or not _pointwise(arg) or len(chain) >= MAX_CHAIN:
            return None
        chain.append(arg)
        work.extend(arg.all_input_nodes)
    return chain


def _tag(node: torch.fx.Node) -> None:
    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    node.meta["ac_graph_id"] = ACTIVATION_AC_GRAPH_ID


def _output_bytes(node: torch.fx.Node) -> int:
    value = node.meta.get("val")
    return tensor_bytes(value[0] if isinstance(value, (tuple, list)) else value)


def tag_activation_recompute(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Tag each cheap op (on the Inductor path: each short pointwise chain) whose inputs the
    backward has anyway ``MUST_RECOMPUTE``."""
    disabled = recompute_disabled(ctx.config, ctx.device)
    if disabled is not None:
        return PassResult(gm, False, {"disabled": disabled})
    backward = backward_nodes(gm)
    decomposed = kernel_path(getattr(ctx.config, "kernels", "auto"), ctx.device) == "inductor"
    side = backward_side(gm, backward) if decomposed else backward
    tagged = saved_bytes = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in side or "recompute" in node.meta:
            continue
        if node.target in CHEAP_OPS:
            reads = backward
            chain = [node] if all(_available_to_backward(arg, backward)
                                  for arg in node.all_input_nodes) else None
        elif decomposed and _pointwise(node):
            reads = side
            chain = _chain(node, side)
        else:
            continue
        if chain is None or not _output_read_by(node, reads):
            continue
        for member in chain:
            _tag(member)
        tagged += 1
        saved_bytes += _output_bytes(node)
    return PassResult(gm, tagged > 0, {"tagged": tagged, "bytes_not_saved": saved_bytes})
