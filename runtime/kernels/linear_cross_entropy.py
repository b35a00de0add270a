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

Numerics follow eager under autocast (``F.cross_entropy(F.linear(h, W, b).float(), t)``):
every matrix product -- the logits (bias added inside the product), ``grad_h``, ``grad_w`` --
runs in the compute dtype of ``h`` and ``W`` (bf16 for a bf16 model; the hardware accumulates
in float32); the log-sum-exp, loss and ``d loss / d logits`` are computed in float32 and the
gradient is stored back in the compute dtype, as autocast's backward casts it for the linear.
With several chunks the weight and bias gradients are summed in float32 and rounded once. The
op's loss is always float32 (``linear_cross_entropy`` returns it in ``h``'s dtype, as
``F.cross_entropy`` would), ``ignore_index`` rows contribute nothing, and a mean over zero
counted rows is NaN as in ``F.cross_entropy``.

Per chunk the non-matmul work is one kernel: on CUDA the Triton kernel of
``zeroc.runtime.kernels.cross_entropy_triton`` (one read for an online log-sum-exp, one read and an
in-place write of the gradient), elsewhere an upcast, a log-softmax, an in-place exp and
scale, and a copy back (``_torch_chunk``).
Environment ``ZEROC_CE_KERNEL`` (``auto``/``triton``/``torch``, see ``chunk_kernel_for``)
overrides the choice; ``triton`` on CPU needs ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType

import torch
from torch.utils.flop_counter import register_flop_formula

__all__ = ["linear_cross_entropy", "loss_and_grads", "chunk_kernel_for", "default_chunk_rows",
           "chunk_rows_for"]

logger = logging.getLogger(__name__)

REDUCTIONS = ("mean", "sum")

# Environment variable choosing the per-chunk kernel (see ``chunk_kernel_for``).
KERNEL_ENV = "ZEROC_CE_KERNEL"
CHUNK_KERNELS = ("auto", "triton", "torch")

# Ways to add a compute-dtype product into a float32 weight gradient (``_accumulate_mm``),
# best first, and the one that worked, per device type and by whether the tensors were fake:
# a planned world's fake CUDA tensors answer for their meta kernels, never for a real GPU's.
_ACCUMULATE_ORDER = ("baddbmm", "mm_out_dtype", "cast")
_accumulate_method: dict[tuple[str, bool], str] = {}


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


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _triton_kernels() -> ModuleType | None:
    """``zeroc.runtime.kernels.cross_entropy_triton``, imported on first use; None without
    triton."""
    try:
        return importlib.import_module("zeroc.runtime.kernels.cross_entropy_triton")
    except ImportError as exc:
        logger.debug("zeroc::linear_cross_entropy: no Triton chunk kernel (%s)", exc)
        return None


def chunk_kernel_for(device: torch.device) -> str:
    """``"triton"`` or ``"torch"``: the path a chunk's log-sum-exp, loss and gradient take.

    Environment ``ZEROC_CE_KERNEL`` (read on every call): ``"auto"`` (default) runs the Triton
    kernel on CUDA tensors when triton imports and torch ops elsewhere; ``"triton"`` always
    runs the kernel (off CUDA only with ``TRITON_INTERPRET=1``: tests); ``"torch"`` never does.
    """
    choice = os.environ.get(KERNEL_ENV, "") or "auto"
    if choice not in CHUNK_KERNELS:
        raise ValueError(f"{KERNEL_ENV}={choice!r}; allowed: {', '.join(CHUNK_KERNELS)}")
    if choice == "torch":
        return "torch"
    if choice == "auto":
        return "triton" if device.type == "cuda" and _triton_kernels() is not None else "torch"
    if device.type != "cuda" and not _interpreting():
        raise RuntimeError(f"{KERNEL_ENV}=triton on a {device.type!r} tensor needs "
                           "TRITON_INTERPRET=1 in the environment before triton is imported")
    if _triton_kernels() is None:
        raise RuntimeError(f"{KERNEL_ENV}=triton, but triton cannot be imported")
    return "triton"


def _torch_chunk(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                 scale: torch.Tensor, loss_out: torch.Tensor, need_grad: bool) -> None:
    """``cross_entropy_chunk`` in torch ops: an upcast (none for float32), one log-softmax,
    an in-place exp and scale, and one copy back into ``logits`` (the downcast)."""
    counted = targets != ignore_index
    safe_targets = torch.where(counted, targets, 0).unsqueeze(1)
    log_probs = torch.log_softmax(logits.float(), 1)
    nll = log_probs.gather(1, safe_targets).squeeze(1).neg_()
    loss_out.copy_(nll.masked_fill_(~counted, 0.0))
    if not need_grad:
        return
    probs = log_probs.exp_()
    probs.scatter_add_(1, safe_targets, counted.to(probs.dtype).neg_().unsqueeze(1))
    # where, not a product: a mean over no counted rows has scale inf, and 0 * inf is NaN.
    logits.copy_(probs.mul_(torch.where(counted, scale, 0.0).unsqueeze(1)))


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` for float32 ``acc`` and ``a``/``b`` in a narrower compute dtype, with
    the product in the compute dtype. Tries, on CUDA, cuBLAS accumulating into ``acc`` itself
    (``baddbmm`` with ``out_dtype``), then a float32-output product added to ``acc``; elsewhere,
    and where those raise, a compute-dtype product (rounded once per chunk) added to ``acc``.
    The first that works is remembered per device type, for fake and real tensors apart."""
    from zeroc.runtime.torch_compat import FakeTensor

    kind = acc.device.type
    key = (kind, isinstance(acc, FakeTensor))
    order = _ACCUMULATE_ORDER if kind == "cuda" else ("cast",)
    for method in order[order.index(_accumulate_method.get(key, order[0])):]:
        try:
            if method == "baddbmm":
                acc3 = acc.unsqueeze(0)
                torch.baddbmm(acc3, a.unsqueeze(0), b.unsqueeze(0), out_dtype=torch.float32,
                              out=acc3)
            elif method == "mm_out_dtype":
                acc.add_(torch.mm(a, b, out_dtype=torch.float32))
            else:
                acc.add_(torch.mm(a, b))
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            if method == "cast":
                raise
            logger.debug("zeroc::linear_cross_entropy: %s accumulation unavailable on %s (%s)",
                         method, kind, exc)
            continue
        _accumulate_method[key] = method
        return


def loss_and_grads(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
    ignore_index: int, reduction: str, chunk_rows: int, need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's body as a plain function: ``(loss, grad_h, grad_w, grad_b)`` as float32 loss
    and gradients in the dtypes of ``h``, ``weight`` and ``bias`` (empty unless
    ``need_grad``); ``chunk_rows=0`` picks ``chunk_rows_for``."""
    _check(h, weight, targets, reduction, chunk_rows)
    rows, width = h.shape
    vocab = weight.shape[0]
    if chunk_rows == 0:
        chunk_rows = chunk_rows_for(rows, width, vocab)
    chunks = max(1, -(-rows // chunk_rows))
    kernel = chunk_kernel_for(h.device)
    chunk_step = _triton_kernels().cross_entropy_chunk if kernel == "triton" else _torch_chunk
    targets = targets.contiguous()
    # F.cross_entropy divides by the number of counted rows (NaN when there are none).
    count = (targets != ignore_index).sum().to(torch.float32)
    scale = (1.0 / count) if reduction == "mean" else torch.ones((), dtype=torch.float32,
                                                                      device=h.device)
    # As autocast's F.linear: the bias in the compute dtype, added inside the product.
    bias_c = bias.to(h.dtype) if bias is not None else None
    loss_rows = torch.empty(rows, dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h) if need_grad else h.new_empty(0)
    # One chunk writes the weight gradient in the compute dtype, as eager does; several add
    # their products in float32 so the sum is rounded once (no rows: zeros).
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) \
        if need_grad and (chunks > 1 or rows == 0) else weight.new_empty(0)
    grad_b = torch.zeros(vocab, dtype=torch.float32, device=h.device) \
        if need_grad and bias is not None else h.new_empty(0)
    logger.debug("zeroc::linear_cross_entropy: %d rows in %d chunks, %s chunk kernel, %s",
                 rows, chunks, kernel, h.dtype)
    for start in range(0, rows, chunk_rows):
        stop = min(start + chunk_rows, rows)
        h_chunk = h[start:stop]
        logits = torch.mm(h_chunk, weight.t()) if bias_c is None \
            else torch.addmm(bias_c, h_chunk, weight.t())
        chunk_step(logits, targets[start:stop], ignore_index, scale, loss_rows[start:stop],
                   need_grad)
        if not need_grad:
            continue
        # ``logits`` now holds d loss / d logits in the compute dtype.
        torch.mm(logits, weight, out=grad_h[start:stop])
        if chunks == 1:
            grad_w = torch.mm(logits.t(), h_chunk)
        elif grad_w.dtype == logits.dtype:
            grad_w.addmm_(logits.t(), h_chunk)
        else:
            _accumulate_mm(grad_w, logits.t(), h_chunk)
        if bias is not None:
            grad_b += logits.sum(0, dtype=torch.float32)
    loss = loss_rows.sum() * scale
    if need_grad:
        grad_w = grad_w.to(weight.dtype)
        if bias is not None:
            grad_b = grad_b.to(bias.dtype)
    return loss, grad_h, grad_w, grad_b


# An explicit schema: the same on every torch version, whatever it infers from annotations.
_SCHEMA = ("(Tensor h, Tensor weight, Tensor? bias, Tensor targets, int ignore_index, "
           "str reduction, int chunk_rows, bool need_grad) -> (Tensor, Tensor, Tensor, Tensor)")


@torch.library.custom_op("zeroc::linear_cross_entropy", mutates_args=(), schema=_SCHEMA)
def _linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
    ignore_index: int, reduction: str, chunk_rows: int, need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, grad_h, grad_w, grad_b)``; the gradients are empty unless ``need_grad``."""
    return loss_and_grads(h, weight, bias, targets, ignore_index, reduction, chunk_rows,
                          need_grad)


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
