"""Find the loss among a pipelined model's outputs and drop the others from the graph.

With ``pp > 1`` a compiled call runs the whole training step and returns the loss of the
whole batch. Models often return more than the loss: a Hugging Face model called with
``labels=`` returns a ``ModelOutput`` holding the loss, the logits and a key/value cache, and
Dynamo hands the backend a graph whose outputs are all of those tensors. No rank of a pipeline
holds the whole batch's logits (the last stage sees one micro-batch at a time), so the
pipeline computes the loss alone.

``rewrite_to_loss(gm, params)`` picks the loss: the one floating 0-d output that depends on a
parameter, or, where there are several, the one all the others feed into (a Hugging Face
mixture-of-experts model with ``output_router_logits=True`` returns ``.loss``, the language
model loss plus the router's auxiliary loss, and ``.aux_loss`` itself). It rewrites the
graph to return that output alone, so nothing else is kept for the call, and records every
other output's shape and dtype: the compiled call returns them as tensors on the ``meta``
device (no data; using one where data is needed raises), so Dynamo can rebuild the model's
output structure and ``output.loss`` reads the real loss. No candidate, or several none of
which holds all the others, is refused with an error that lists the outputs found.

``check_sum_over_samples(gm, index, batch_inputs)`` refuses a loss that is not a sum over
the batch's samples, read from the graph Dynamo traced with a symbolic batch size: a pipeline
computes the loss per micro-batch and adds the parts, which is the batch's loss only when no
value the loss is computed from combines the batch's samples before the loss's own final
reduction. A floating value that needs a gradient and depends on the batch, but whose shape
has lost the batch's size while an input's shape had it (``x.T @ x``, ``x.mean(0)``, ``x[0]``)
combines samples; it is allowed only as the loss's final reduction (a ``sum``, ``mean`` or
cross-entropy that nothing after it mixes with per-sample values again). A shape carrying a
data-dependent size (a mixture-of-experts' routed rows) counts as following the batch. An op
that mixes samples without changing the shape (batch norm) is not seen. The error names the
op and its line in the model.

Evaluation. A graph Dynamo traced with gradients off (``torch.no_grad()``,
``torch.inference_mode()``: the graph runs only so) keeps, after the loss, every output that
holds one row per sample: a tensor whose first dimension is the batch and that is computed
from a batch input (a language model's logits, a classifier's scores). The pipeline returns
them whole, concatenated over the micro-batches and sent to every rank of the pipeline
(``zeroc.runtime.pipeline.outputs``); other outputs stay on the ``meta`` device. Such a graph
needs no loss at all: a model called without labels returns its logits.

``keep_loss_output(gm, ctx)`` is the pass (``run_passes``, with a
``zeroc.passes.front.context.FrontContext``): ``rewrite_to_loss`` in place, the
``LossOutput`` published as ``ctx.loss_output``.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import free_symbols, free_unbacked_symbols

from zeroc.passes.base import PassContext, PassResult
from zeroc.passes.front.context import front_context
from zeroc.passes.front.loss_normalization import LossReductionError, reads_parameter
from zeroc.runtime.torch_compat import tree_flatten

__all__ = ["LossOutput", "check_sum_over_samples", "keep_loss_output", "rewrite_to_loss"]


@dataclasses.dataclass(frozen=True)
class LossOutput:
    """Where the loss sits among the graph's original outputs and what the others were.

    ``others[i]`` is ``(shape, dtype)`` of output ``i`` (``None`` at ``index``, and for a
    non-tensor output, which is returned as it was traced). ``index`` is None for an
    evaluation graph without a loss; ``kept`` are the per-sample outputs an evaluation graph
    returns after the loss, in output order (module docstring)."""

    index: int | None
    count: int
    others: tuple[tuple[tuple[int, ...], torch.dtype] | None, ...]
    constants: tuple[Any, ...]
    kept: tuple[int, ...] = ()

    @property
    def kept_specs(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """``(shape, dtype)`` at the call's sizes of each kept output."""
        return tuple(self.others[i] for i in self.kept)  # type: ignore[misc]

    def outputs(self, loss: torch.Tensor,
                kept: tuple[torch.Tensor, ...] = ()) -> tuple[Any, ...]:
        """The call's outputs: ``loss`` at its place, ``kept`` at theirs, meta tensors (or
        constants) elsewhere."""
        values = dict(zip(self.kept, kept, strict=True))
        result: list[Any] = []
        for i, spec in enumerate(self.others):
            if i == self.index:
                result.append(loss)
            elif i in values:
                result.append(values[i])
            elif spec is None:
                result.append(self.constants[i])
            else:
                result.append(torch.empty(spec[0], dtype=spec[1], device="meta"))
        return tuple(result)


def _value(arg: Any) -> Any:
    return arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else arg


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return seen


def _total(flat: list[Any], candidates: list[int]) -> list[int]:
    """The candidates every other candidate is computed into (the total of several losses)."""
    if len(candidates) < 2:
        return candidates
    totals = []
    for i in candidates:
        ancestors = _ancestors(flat[i])
        if all(flat[j] in ancestors for j in candidates if flat[j] is not flat[i]):
            totals.append(i)
    return totals


def keep_loss_output(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Pass: ``rewrite_to_loss(gm, ctx.params)`` (in place); publishes ``ctx.loss_output``."""
    front = front_context(ctx, "keep_loss_output")
    output = next(n for n in gm.graph.nodes if n.op == "output")
    before = output.args
    kept = front.kept_outputs
    if front.evaluation and kept is None:
        kept = per_sample_outputs(gm, front.batch_inputs, front.traced_batch)
    front.loss_output = found = rewrite_to_loss(gm, front.params, kept or ())
    return PassResult(gm, output.args != before,
                      {"loss_index": found.index, "kept_outputs": len(found.kept),
                       "dropped_outputs": found.count - len(found.kept)
                       - (found.index is not None)})


def per_sample_outputs(gm: torch.fx.GraphModule, batch_inputs: set[int] | frozenset[int],
                       batch: int) -> tuple[int, ...]:
    """The flat outputs of ``gm`` with one row per sample: a tensor whose dimension 0 is
    ``batch`` and that is computed from one of the ``batch_inputs`` (placeholder positions)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    sources = {placeholders[i] for i in batch_inputs if i < len(placeholders)}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    kept = []
    for i, arg in enumerate(tree_flatten(output.args[0])[0]):
        value = _value(arg)
        if (isinstance(arg, torch.fx.Node) and isinstance(value, torch.Tensor)
                and value.dim() > 0 and value.shape[0] == batch
                and (arg in sources or _ancestors(arg) & sources)):
            kept.append(i)
    return tuple(kept)


def rewrite_to_loss(gm: torch.fx.GraphModule, params: set[int],
                    kept: tuple[int, ...] = ()) -> LossOutput:
    """Rewrite ``gm`` (in place) to return its loss, then the flat outputs at ``kept`` (an
    evaluation graph's, which needs no loss if it keeps any); ``params``: parameter
    positions."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    param_names = {placeholders[i].name for i in params if i < len(placeholders)}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    flat, _ = tree_flatten(output.args[0])
    values = [_value(a) for a in flat]
    candidates = [
        i for i, (arg, value) in enumerate(zip(flat, values, strict=True))
        if isinstance(arg, torch.fx.Node) and isinstance(value, torch.Tensor)
        and value.dim() == 0 and value.is_floating_point() and reads_parameter(arg, param_names)
        and i not in kept
    ]
    candidates = _total(flat, candidates) or candidates
    if not candidates and kept:  # an evaluation without a loss
        return _rewrite_outputs(gm, output, flat, values, None, kept)
    if len(candidates) != 1:
        found = ", ".join(_describe(v) for v in values) or "nothing"
        reason = ("no floating scalar that depends on the parameters" if not candidates else
                  f"{len(candidates)} floating scalars that depend on the parameters "
                  f"(outputs {candidates})")
        raise ValueError(
            "zeroc pipeline: with pp > 1 the compiled call runs the whole training step and "
            "returns the loss, so the model must return one scalar loss (a tensor, or a "
            f"Hugging Face output with .loss: pass labels=); its outputs are [{found}]: "
            f"{reason}. Return the loss (e.g. F.cross_entropy(logits, targets)) alone, or "
            "sum several losses into one"
        )
    return _rewrite_outputs(gm, output, flat, values, candidates[0], kept)


def _rewrite_outputs(gm: torch.fx.GraphModule, output: torch.fx.Node, flat: list[Any],
                     values: list[Any], index: int | None, kept: tuple[int, ...]) -> LossOutput:
    others = tuple(None if i == index or not isinstance(v, torch.Tensor) else
                   (tuple(int(s) for s in v.shape), v.dtype) for i, v in enumerate(values))
    constants = tuple(None if isinstance(v, torch.Tensor) or isinstance(a, torch.fx.Node)
                      else v for a, v in zip(flat, values, strict=True))
    if any(isinstance(a, torch.fx.Node) and not isinstance(v, torch.Tensor) and i != index
           for i, (a, v) in enumerate(zip(flat, values, strict=True))):
        raise ValueError("zeroc pipeline: the model returns a value computed in the graph "
                         "that is not a tensor; with pp > 1 return the loss alone")
    # Nodes only the dropped outputs read stay: the stage graphs are traced functionally from
    # the loss, so AOTAutograd leaves them out, and a side effect among them is kept.
    output.args = (tuple(flat[i] for i in ((index,) if index is not None else ()) + kept),)
    gm.recompile()
    return LossOutput(index=index, count=len(flat), others=others, constants=constants,
                      kept=kept)


# A loss's own final reduction over the batch (``passes/front/loss_normalization.py`` reads these).
_FINAL = {torch.sum, torch.mean, "sum", "mean", F.cross_entropy, F.nll_loss}


def _final_reduction(node: torch.fx.Node) -> bool:
    if node.target is torch.ops.zeroc.linear_cross_entropy.default:
        return True
    if node.op == "call_function" and node.target is operator.getitem:
        return False
    if node.target in _FINAL:
        return node.target in (F.cross_entropy, F.nll_loss) or (
            len(node.args) == 1 and node.kwargs.get("dim") is None)
    return False


def _where(node: torch.fx.Node) -> str:
    """The model's line a Dynamo node comes from (``file:line: code``), or its name."""
    lines = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines()]
    files = [i for i, line in enumerate(lines) if line.startswith("File ")]
    if not files:
        return f"node {node.name}"
    at = lines[files[-1]].removeprefix("File ").replace(", line ", ":").split(",")[0]
    at = at.replace('"', "")
    code = lines[files[-1] + 1] if files[-1] + 1 < len(lines) else ""
    return f"{at} ({code})" if code else at


def check_sum_over_samples(gm: torch.fx.GraphModule, loss_index: int,
                           batch_inputs: set[int] | frozenset[int]) -> None:
    """Raise ``LossReductionError`` when the loss (flat output ``loss_index`` of ``gm``, a graph
    with a symbolic batch size) combines samples before its final reduction (module
    docstring). A graph without a symbolic batch size is not checked."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    batch: set[Any] = set()
    for index in batch_inputs:
        value = _value(placeholders[index]) if index < len(placeholders) else None
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            batch |= free_symbols(value.shape[0])
    if not batch:
        return
    output = next(n for n in gm.graph.nodes if n.op == "output")
    loss = tree_flatten(output.args[0])[0][loss_index]
    if not isinstance(loss, torch.fx.Node):
        return
    cone = _ancestors(loss) | {loss}
    sources = {placeholders[i] for i in batch_inputs if i < len(placeholders)}

    def follows(node: torch.fx.Node) -> bool:
        value = _value(node)
        return isinstance(value, torch.Tensor) and bool(
            free_unbacked_symbols(value) or any(free_symbols(s) & batch for s in value.shape))

    depends: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:  # in order: inputs first
        if node in cone and (node in sources or any(a in depends for a in node.all_input_nodes)):
            depends.add(node)
    for node in gm.graph.nodes:
        value = _value(node)
        if node not in depends or not isinstance(value, torch.Tensor) or follows(node) \
                or not value.is_floating_point() or not value.requires_grad \
                or not any(follows(a) for a in node.all_input_nodes):
            continue
        later, work = set(), list(node.users)
        while work:
            current = work.pop()
            if current in cone and current not in later:
                later.add(current)
                work.extend(current.users)
        if _final_reduction(node) and not any(follows(n) for n in later):
            continue
        name = node.target if isinstance(node.target, str) else getattr(
            node.target, "__name__", str(node.target))
        raise LossReductionError(
            f"zeroc pipeline: the loss is not a sum over the batch's samples: {name} at "
            f"{_where(node)} combines the samples of the batch into a "
            f"({', '.join(str(s) for s in value.shape)}) value the loss is computed from, so the "
            "micro-batches' losses do not add up to the batch's loss. Compute the loss per "
            "sample and reduce over the batch last (a sum or mean of per-sample losses), or "
            "pass options={'loss_reduction': 'mean'} (average the micro-batches' losses) or "
            "{'loss_reduction': 'sum'} (add them) to combine them anyway")
