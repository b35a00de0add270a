"""One chunk of cross-entropy over logits in one Triton kernel: loss and d loss / d logits.

``zeroc::linear_cross_entropy`` (``zeroc.runtime.kernels.linear_cross_entropy``) computes a chunk of
logits with a matrix product and hands it here. One program per row reads the row's logits
once to build its log-sum-exp online (a running maximum and a running sum of exponentials
over the vocabulary in blocks of ``BLOCK``, as Liger Kernel's fused linear cross-entropy
does), writes the row's loss (float32) and, when ``NEED_GRAD``, reads the row a second time
and overwrites it in place with ``(softmax - one_hot(target)) * scale`` in the logits' dtype,
so the next matrix products consume it as it is. All arithmetic is float32.

Numerics follow eager ``F.cross_entropy`` (``log_softmax`` then ``nll_loss``):

- a NaN logit makes the row's log-sum-exp, loss and gradient NaN; ``+inf`` does too (eager's
  ``x - max`` is ``inf - inf``); a row of only ``-inf`` has NaN loss and gradient;
- an ignored row (``target == ignore_index``) adds 0 to the loss and has gradient
  ``softmax * 0``, which is 0 -- or NaN where its logits are NaN, as in eager's backward;
- a target outside ``[0, vocab)`` on a counted row gives a NaN loss instead of reading out of
  bounds (eager raises on CPU and asserts on CUDA).

This module imports ``triton`` at the top; ``zeroc.runtime.kernels.linear_cross_entropy`` imports it
only when it runs the Triton path, so the package imports without triton. On CPU the kernel
runs only in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

__all__ = ["cross_entropy_chunk", "block_for", "MAX_BLOCK"]

logger = logging.getLogger(__name__)

# Most vocabulary entries a program holds per step (float32: 64 KiB of registers at 16 warps).
MAX_BLOCK = 16384


@triton.jit
def _cross_entropy_chunk_kernel(
    logits_ptr, logits_row_stride, targets_ptr, loss_ptr, scale_ptr, n_cols, ignore_index,
    NEED_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    target = tl.load(targets_ptr + row)
    counted = target != ignore_index
    in_range = (target >= 0) & (target < n_cols)
    lanes = tl.arange(0, BLOCK)

    # Pass 1: running maximum and sum of exp(x - maximum), a block at a time (one exp per
    # logit). While the maximum is still -inf the shift is 0, so exp(-inf - shift) is 0, not
    # exp(-inf + inf) = NaN. A NaN logit reaches the sum through exp(x - shift) whether or not
    # the maximum keeps it.
    run_max = float("-inf")
    run_sum = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, tl.max(x, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        run_max = new_max
    lse = tl.where(run_max == float("-inf"), 0.0, run_max) + tl.log(run_sum)

    target_logit = tl.load(row_ptr + tl.where(in_range, target, 0), mask=in_range,
                           other=float("nan")).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(counted, lse - target_logit, 0.0))

    if NEED_GRAD:
        scale = tl.load(scale_ptr).to(tl.float32)
        row_scale = tl.where(counted, scale, 0.0)
        # Pass 2: the row's own logits, read again and overwritten with the gradient.
        for start in range(0, n_cols, BLOCK):
            cols = start + lanes
            mask = cols < n_cols
            x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            one_hot = tl.where((cols == target) & counted, 1.0, 0.0)
            grad = (tl.exp(x - lse) - one_hot) * row_scale
            tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def block_for(n_cols: int) -> int:
    """Vocabulary entries per step: the next power of two of ``n_cols``, at most MAX_BLOCK."""
    return min(triton.next_power_of_2(max(n_cols, 1)), MAX_BLOCK)


def _num_warps(block: int) -> int:
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def cross_entropy_chunk(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, scale: torch.Tensor,
    loss_out: torch.Tensor, need_grad: bool, block: int | None = None,
) -> None:
    """Write each row's loss into ``loss_out`` and, if ``need_grad``, overwrite ``logits``.

    ``logits`` is ``(rows, vocab)`` with unit column stride, in any float dtype; ``targets``
    ``(rows,)`` integer class indices; ``scale`` a 0-dim float32 tensor (``1 / count`` for a
    mean, 1 for a sum) applied to the gradient only; ``loss_out`` ``(rows,)`` contiguous
    float32, ``lse - logit[target]`` on counted rows and 0 on ignored ones. ``block`` (a power
    of two) overrides :func:`block_for`, e.g. to test a vocabulary spanning several blocks.
    """
    rows, n_cols = logits.shape
    if logits.stride(1) != 1 or not targets.is_contiguous() or not loss_out.is_contiguous():
        raise ValueError("cross_entropy_chunk: logits need unit column stride, targets and "
                         "loss_out must be contiguous")
    if loss_out.dtype != torch.float32 or loss_out.shape != (rows,) or targets.shape != (rows,):
        raise ValueError(f"cross_entropy_chunk: expected targets ({rows},) and float32 loss_out "
                         f"({rows},); got {tuple(targets.shape)}, {loss_out.dtype} "
                         f"{tuple(loss_out.shape)}")
    if rows == 0:
        return
    block = block or block_for(n_cols)
    if block & (block - 1):
        raise ValueError(f"cross_entropy_chunk: block={block} is not a power of two")
    scale = scale.to(device=logits.device, dtype=torch.float32).reshape(())
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("cross_entropy_chunk: %d x %d %s, block %d, need_grad=%s", rows, n_cols,
                     logits.dtype, block, need_grad)
    _cross_entropy_chunk_kernel[(rows,)](
        logits, logits.stride(0), targets, loss_out, scale, n_cols, ignore_index,
        NEED_GRAD=need_grad, BLOCK=block, num_warps=_num_warps(block),
    )
