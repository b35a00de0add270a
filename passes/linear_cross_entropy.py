"""Fuse a linear layer and the cross-entropy on its output into ``zeroc::linear_cross_entropy``.

Runs on the Dynamo graph (torch-level IR), before AOTAutograd. It rewrites

    logits = F.linear(h, W, b)            # (..., vocab)
    loss = F.cross_entropy(logits.view(-1, vocab), targets.view(-1))

into one call of the chunked op of ``zeroc.runtime.kernels.linear_cross_entropy``, which never holds
more than one chunk of logits and, when training, computes the gradients of ``h``, ``W`` and
``b`` during the forward. The language-model head of a GPT or Llama is the usual match; its
``rows x vocab`` logits, their log-softmax and their gradient are then never materialized.

A match must be exact, or the graph is left as it is and the reason is counted in the stats:

- the logits feed only the cross-entropy (through views/reshapes that keep the last dim);
- class-index targets, ``weight=None``, ``label_smoothing=0``, reduction ``"mean"`` or
  ``"sum"`` (a scalar loss: the op's backward scales the precomputed gradients by it);
- under autocast (a region in the graph, or autocast already on when the graph is compiled)
  the head's inputs are cast to the autocast dtype first, as autocast casts ``F.linear``'s;
  the op then upcasts the logits to float32 for the loss, as autocast runs ``cross_entropy``
  in float32. Autocast on another device type is ignored, as eager ignores it.

Option ``fused_loss``: ``True`` rewrites every match, ``False`` none. ``"auto"`` (default)
rewrites every match on CUDA, where the op runs its one-pass Triton chunk kernel; elsewhere
(the CPU, where each chunk takes several aten passes and the step is about 6% longer) only a
match whose logits are large, ``rows x vocab x 4`` bytes at least 1/2048 of the device's
memory (``LARGE_LOGITS_FRACTION``: 12 MiB on a 24 GiB machine, about the logits of 1k tokens
over a 3k vocabulary): a real vocabulary's logits are fused, where the memory saved matters;
a toy head's, whose memory is noise and whose chunking only costs time, are not. The pass's
stats name each match it left for being small.
"""

from __future__ import annotations

import inspect
import operator
from collections import Counter
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

import zeroc.runtime.kernels.linear_cross_entropy  # noqa: F401  (registers the op)
from zeroc.passes.base import PassContext, PassResult
from zeroc.runtime.cost.cost import concrete
from zeroc.runtime.cost.hardware import device_memory_bytes
from zeroc.runtime.plan.plan_format import human_bytes
from zeroc.runtime.torch_compat import ENTER_AUTOCAST, EXIT_AUTOCAST, FakeTensor

_LINEAR_TARGETS = {F.linear}  # torch._C._nn.linear itself
_RESHAPE_METHODS = {"view", "reshape", "flatten"}
_RESHAPE_FUNCTIONS = {torch.reshape, torch.flatten}
_AUTOCAST_ENTER = {ENTER_AUTOCAST}
_AUTOCAST_EXIT = {EXIT_AUTOCAST}
_CE_SIGNATURE = inspect.signature(F.cross_entropy)
# fused_loss="auto" off CUDA: logits at least this fraction of the device's memory are fused.
LARGE_LOGITS_FRACTION = 1 / 2048


def _small_logits(setting: object, device: torch.device, logits: torch.Tensor) -> str | None:
    """Why ``fused_loss="auto"`` leaves a match of ``logits`` unfused; None: fuse it."""
    if setting != "auto" or device.type == "cuda":
        return None
    # The float32 logits the loss reads (and their gradient); a symbolic size's hint, since
    # comparing the size itself would guard on it (a recompile per sequence length).
    nbytes = concrete(logits.numel()) * 4
    limit = device_memory_bytes(device) * LARGE_LOGITS_FRACTION
    if nbytes >= limit:
        return None
    return (f"fused_loss='auto': logits of {human_bytes(nbytes)} are under 1/2048 of the "
            f"{device.type} memory")


def _value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def _is_reshape(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _RESHAPE_METHODS
    return node.op == "call_function" and node.target in _RESHAPE_FUNCTIONS


def _logits_source(node: torch.fx.Node) -> tuple[torch.fx.Node | None, list[torch.fx.Node]]:
    """The linear node behind a chain of single-use reshapes ending at ``node``, and the chain."""
    chain = []
    while _is_reshape(node):
        chain.append(node)
        source = node.args[0]
        if not isinstance(source, torch.fx.Node) or len(source.users) != 1:
            return None, chain
        node = source
    if node.op == "call_function" and node.target in _LINEAR_TARGETS:
        return node, chain
    return None, chain


def _autocast_regions(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, tuple]:
    """For each node inside ``_enter_autocast`` ... ``_exit_autocast``: the innermost region's
    ``(device_type, dtype, enabled)``."""
    inside: dict[torch.fx.Node, tuple] = {}
    stack: list[tuple] = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _AUTOCAST_ENTER:
            device_type, dtype, enabled = (list(node.args) + [None, None, True])[:3]
            stack.append((device_type, dtype, enabled))
        elif node.op == "call_function" and node.target in _AUTOCAST_EXIT:
            if stack:
                stack.pop()
        elif stack:
            inside[node] = stack[-1]
    return inside


def autocast_dtype(node: torch.fx.Node, regions: dict[torch.fx.Node, tuple],
                   device: torch.device) -> torch.dtype | None:
    """The dtype autocast casts ``node``'s matmul inputs to on ``device``; ``None`` if off."""
    if node in regions:
        device_type, dtype, enabled = regions[node]
        if device_type != device.type:
            return None
        if not enabled:
            return None
        return dtype if dtype is not None else torch.get_autocast_dtype(device.type)
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def _skip_reason(ce: torch.fx.Node) -> tuple[str | None, dict[str, Any]]:
    """Why this cross-entropy cannot be fused (``None`` if it can), and its bound arguments."""
    try:
        bound = _CE_SIGNATURE.bind(*ce.args, **ce.kwargs)
    except TypeError:
        return "unrecognised arguments", {}
    bound.apply_defaults()
    args = dict(bound.arguments)
    if args["weight"] is not None or args["size_average"] is not None \
            or args["reduce"] is not None:
        return "class weights or legacy reduction arguments", args
    if args["label_smoothing"] != 0.0:
        return "label smoothing", args
    if args["reduction"] not in ("mean", "sum") or isinstance(args["ignore_index"],
                                                              torch.fx.Node):
        return "reduction not mean/sum", args
    logits, target = _value(args["input"]), _value(args["target"])
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        return "no example values", args
    if logits.dim() != 2 or target.dim() != 1 or target.is_floating_point():
        return "not (rows, classes) logits with class-index targets", args
    return None, args


def fuse_linear_cross_entropy(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace each linear -> cross-entropy pair by ``zeroc::linear_cross_entropy``."""
    setting = getattr(ctx.config, "fused_loss", "auto")
    if setting is False:
        return PassResult(gm, False, {"disabled": True})
    graph = gm.graph
    regions = _autocast_regions(gm)
    skipped: Counter[str] = Counter()
    rewritten = autocast_rewrites = 0
    for ce in list(graph.nodes):
        if ce.op != "call_function" or ce.target is not F.cross_entropy:
            continue
        reason, args = _skip_reason(ce)
        linear, chain = (None, [])
        if reason is None:
            linear, chain = _logits_source(args["input"])
            if linear is None or len(linear.users) != 1 or len(args["input"].users) != 1:
                reason = "logits used by more than the loss"
        if reason is None:
            h, weight = linear.args[0], linear.args[1]
            bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
            h_value, w_value = _value(h), _value(weight)
            logits_value = _value(linear)
            if not isinstance(h_value, torch.Tensor) or h_value.dim() < 2 \
                    or not isinstance(w_value, torch.Tensor) or w_value.dim() != 2 \
                    or logits_value.shape[-1] != _value(args["input"]).shape[-1]:
                reason = "reshapes that do not keep the class dimension last"
        if reason is None:
            reason = _small_logits(setting, ctx.device, logits_value)
        if reason is not None:
            skipped[reason] += 1
            continue
        # The pipeline path traces its stage graphs for training even under no_grad.
        need_grad = bool(ctx.extras.get("need_grad", logits_value.requires_grad))
        cast = autocast_dtype(ce, regions, h_value.device)
        first_new = ce.prev
        with graph.inserting_before(ce):
            if cast is not None:  # what autocast does to F.linear's inputs
                h, weight = (graph.call_method("to", (h, cast)),
                             graph.call_method("to", (weight, cast)))
                if bias is not None:
                    bias = graph.call_method("to", (bias, cast))
            rows = graph.call_function(torch.flatten, (h, 0, -2))
            fused = graph.call_function(
                torch.ops.zeroc.linear_cross_entropy.default,
                (rows, weight, bias, args["target"], int(args["ignore_index"]),
                 args["reduction"], 0, need_grad))
            loss = graph.call_function(operator.getitem, (fused, 0))
            loss_dtype = getattr(_value(ce), "dtype", torch.float32)
            if loss_dtype != torch.float32:  # the op's loss is float32; eager's is the logits'
                loss = graph.call_method("to", (loss, loss_dtype))
        _trace_meta(_nodes_between(first_new, ce), linear)
        loss.meta.update(ce.meta)
        ce.replace_all_uses_with(loss)
        for node in [ce, *chain, linear]:
            graph.erase_node(node)
        rewritten += 1
        autocast_rewrites += cast is not None
    stats: dict[str, Any] = {"rewritten": rewritten}
    if autocast_rewrites:
        stats["autocast"] = autocast_rewrites
    if skipped:
        stats["skipped"] = "; ".join(f"{k}: {v}" for k, v in sorted(skipped.items()))
    return PassResult(gm, rewritten > 0, stats)


def _nodes_between(after: torch.fx.Node, before: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes strictly between ``after`` and ``before`` in graph order."""
    nodes, node = [], after.next
    while node is not before:
        nodes.append(node)
        node = node.next
    return nodes


def _trace_meta(nodes: list[torch.fx.Node], linear: torch.fx.Node) -> None:
    """Give inserted nodes what Dynamo gives its own: an ``example_value`` (run on the fake
    inputs) and the ``nn_module_stack`` of the head they replace, so later graph passes (the
    micro-batch shapes and stage split of a pipeline) read them as any other node."""
    # The mode of Dynamo's example values (not the tracing context's, which AOTAutograd uses).
    fake_mode = next((v.fake_mode for n in nodes for a in n.all_input_nodes
                      if isinstance(v := _value(a), FakeTensor)), None)
    for node in nodes:
        if "nn_module_stack" in linear.meta:
            node.meta["nn_module_stack"] = linear.meta["nn_module_stack"]
        if fake_mode is None:
            continue
        args = torch.fx.node.map_arg(node.args, _value)
        with fake_mode:
            if node.op == "call_method":
                value = getattr(args[0], node.target)(*args[1:])
            else:
                value = node.target(*args)
        node.meta["example_value"] = value
