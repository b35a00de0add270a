"""``zeroc::linear_cross_entropy``: a language-model head and its loss without the logits.

``F.cross_entropy(h @ W.T + b, targets)`` materializes ``rows x vocab`` logits, keeps their
log-softmax for the backward and, in the backward, makes two more tensors of that size (the
gradient of the log-softmax and of the logits). For a 4096-word vocabulary and 1024 rows that
is 16 MiB each, and it is usually the largest thing alive at the turn from forward to backward.

This op walks the rows in chunks of ``chunk_rows`` (0: ``chunk_rows_for``). For each
chunk it computes the logits, the log-sum-exp and the loss, and -- when ``need_grad`` --
turns the same chunk of logits in place into ``d loss / d logits`` (softmax minus the one-hot
target, scaled by the reduction) and multiplies it straight into the gradients of ``h``, ``W``
and ``b``. Only one chunk of logits exists at a time. The total work is the same as eager's
(one forward and two backward matrix products per chunk); what is saved for the backward is
``grad_h`` (rows x width) and ``grad_w`` (vocab x width) instead of the log-softmax
(rows x vocab).

The loss is linear in what autograd sends back, so the backward is only ``grad_out * grad_h``
etc. Invariant: this holds because the op's loss is a scalar (``reduction`` is ``"mean"`` or
``"sum"``); ``reduction="none"`` is not offered. Second derivatives are not supported.

Numerics follow eager: logits in the dtype of ``h`` (a bf16 model multiplies in bf16), the
log-sum-exp and the loss in float32 (the op's loss is always float32; ``linear_cross_entropy``
returns it in ``h``'s dtype, as ``F.cross_entropy`` would), ``ignore_index`` rows contribute
nothing, and a mean over zero counted rows is NaN as in ``F.cross_entropy``.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

__all__ = ["linear_cross_entropy", "default_chunk_rows", "chunk_rows_for"]

REDUCTIONS = ("mean", "sum")


# Fewest rows a chunk gets when the weight allows it (see ``chunk_rows_for``).
MIN_CHUNK_ROWS = 256


def default_chunk_rows(rows: int, width: int, vocab: int) -> int:
    """Rows per chunk by memory alone: ``ceil(vocab / width)`` chunks, so a chunk of logits is
    about as large as ``h`` itself (``rows x width``)."""
    chunks = max(1, -(-vocab // max(width, 1)))
    return max(1, -(-rows // chunks))


def chunk_rows_for(rows: int, width: int, vocab: int) -> int:
    """Rows per chunk when the caller gives none: ``default_chunk_rows``, raised to
    ``MIN_CHUNK_ROWS`` (or ``width``, or ``rows``, if smaller).

    Every chunk reads the weight twice and adds a rank-``chunk_rows`` update into the whole
    ``vocab x width`` weight gradient, so thin chunks spend their time moving the weight and
    its gradient rather than multiplying: on a CPU core the 1024 x 256 -> 4096 head of the
    benchmark GPT runs its forward and backward in 64-row chunks 17% slower than in 256-row
    chunks (and slower than eager). At most ``width`` rows keeps a chunk of logits
    (``chunk_rows x vocab``) no larger than the weight gradient the op holds anyway."""
    floor = min(MIN_CHUNK_ROWS, max(width, 1), rows)
    return max(default_chunk_rows(rows, width, vocab), floor)


def _check(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str,
           chunk_rows: int) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"zeroc::linear_cross_entropy: reduction={reduction!r} is not "
                         f"allowed; allowed are {list(REDUCTIONS)}")
    if chunk_rows < 0:
        raise ValueError(f"zeroc::linear_cross_entropy: chunk_rows={chunk_rows} must be >= 1, "
                         "or 0 for the default")
    if h.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError("zeroc::linear_cross_entropy: expected h (rows, width), weight "
                         f"(vocab, width), targets (rows,); got {tuple(h.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)}")


# An explicit schema: the same on every torch version, whatever it infers from annotations.
_SCHEMA = ("(Tensor h, Tensor weight, Tensor? bias, Tensor targets, int ignore_index, "
           "str reduction, int chunk_rows, bool need_grad) -> (Tensor, Tensor, Tensor, Tensor)")


@torch.library.custom_op("zeroc::linear_cross_entropy", mutates_args=(), schema=_SCHEMA)
def _linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
    ignore_index: int, reduction: str, chunk_rows: int, need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, grad_h, grad_w, grad_b)``; the gradients are empty unless ``need_grad``."""
    _check(h, weight, targets, reduction, chunk_rows)
    rows = h.shape[0]
    if chunk_rows == 0:
        chunk_rows = chunk_rows_for(rows, h.shape[1], weight.shape[0])
    counted = targets != ignore_index
    # F.cross_entropy divides by the number of counted rows (NaN when there are none).
    count = counted.sum().to(torch.float32)
    scale = (1.0 / count) if reduction == "mean" else torch.ones((), dtype=torch.float32,
                                                                      device=h.device)
    loss_sum = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h) if need_grad else h.new_empty(0)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) \
        if need_grad else weight.new_empty(0)
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device) \
        if need_grad and bias is not None else h.new_empty(0)
    for start in range(0, rows, chunk_rows):
        stop = min(start + chunk_rows, rows)
        h_chunk = h[start:stop]
        logits = h_chunk @ weight.t()
        if bias is not None:
            logits = logits + bias
        logits = logits.float()
        chunk_targets = targets[start:stop]
        chunk_counted = counted[start:stop]
        safe_targets = torch.where(chunk_counted, chunk_targets, 0).unsqueeze(1)
        lse = torch.logsumexp(logits, dim=1)
        target_logit = logits.gather(1, safe_targets).squeeze(1)
        loss_sum += torch.where(chunk_counted, lse - target_logit, 0.0).sum()
        if not need_grad:
            continue
        # d loss / d logits = (softmax - one_hot(target)) * scale, zero on ignored rows.
        probs = logits.sub_(lse.unsqueeze(1)).exp_()
        probs.scatter_add_(1, safe_targets, -chunk_counted.to(probs.dtype).unsqueeze(1))
        probs.mul_((chunk_counted.to(probs.dtype) * scale).unsqueeze(1))
        grad_logits = probs.to(h.dtype)
        grad_h[start:stop] = grad_logits @ weight
        grad_w.addmm_(grad_logits.t().to(grad_w.dtype), h_chunk.to(grad_w.dtype))
        if bias is not None:
            grad_b += probs.sum(0)
    loss = loss_sum * scale
    if need_grad:
        grad_w = grad_w.to(weight.dtype)
        if bias is not None:
            grad_b = grad_b.to(bias.dtype)
    return loss, grad_h, grad_w, grad_b


@_linear_cross_entropy.register_fake
def _(h, weight, bias, targets, ignore_index, reduction, chunk_rows, need_grad):
    loss = h.new_empty((), dtype=torch.float32)
    grad_h = torch.empty_like(h) if need_grad else h.new_empty(0)
    grad_w = torch.empty_like(weight) if need_grad else weight.new_empty(0)
    grad_b = bias.new_empty(bias.shape) if need_grad and bias is not None else h.new_empty(0)
    return loss, grad_h, grad_w, grad_b


def _setup_context(ctx, inputs, output) -> None:
    h, weight, bias, _targets, _ignore, _reduction, _chunk, need_grad = inputs
    _loss, grad_h, grad_w, grad_b = output
    if not need_grad and any(t is not None and t.requires_grad for t in (h, weight, bias)):
        raise RuntimeError("zeroc::linear_cross_entropy ran with need_grad=False on inputs "
                           "that require grad; its gradients were not computed")
    ctx.has_bias = bias is not None
    ctx.save_for_backward(grad_h, grad_w, grad_b)


def _backward(ctx, grad_loss, _gh, _gw, _gb):
    grad_h, grad_w, grad_b = ctx.saved_tensors
    grad_bias = grad_loss * grad_b if ctx.has_bias else None
    return grad_loss * grad_h, grad_loss * grad_w, grad_bias, None, None, None, None, None


_linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
    ignore_index: int = -100, reduction: str = "mean", chunk_rows: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(h, weight, bias), targets)`` for 2-d ``h``, chunked.

    Gradients are computed in the forward when grad mode is on and an input requires them.
    """
    need_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (h, weight, bias))
    loss = _linear_cross_entropy(h, weight, bias, targets, ignore_index, reduction,
                                 chunk_rows or 0, need_grad)[0]
    return loss.to(h.dtype)


@register_flop_formula(torch.ops.zeroc.linear_cross_entropy)
def _flops(h_shape, weight_shape, _bias_shape, _targets_shape, _ignore_index, _reduction,
           _chunk_rows, need_grad, *args, **kwargs) -> int:
    """One matrix product forward, two more (for ``grad_h`` and ``grad_w``) when training."""
    rows, width = h_shape
    products = 3 if need_grad else 1
    return products * 2 * rows * width * weight_shape[0]
