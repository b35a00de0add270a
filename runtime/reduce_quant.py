"""Quantized gradient reduction with error feedback (ZeRO++'s qgZ, 1-bit Adam's feedback).

With ``options={"reduce_quant": "int8" | "int4"}`` a ZeRO-1/2/3 gradient reduction of a
bucket laid out rank-major (row ``r``: every gradient's piece that rank ``r`` keeps) runs as:

1. ``zeroc::quantize_grad_rows(rows, ranks, bits, block, key)``: this step's rows in float32
   plus the rounding error this rank made on the same bucket last step (the *error feedback*
   residual, kept under ``key``), quantized blockwise per row: blocks of ``block`` elements
   with one float32 scale each, ``max |x| / L`` with ``L`` = 127 (int8) or 7 (int4, two values
   per byte), values rounded half away from zero. The new residual (what was sent minus what
   it stands for) is kept for the next step, so the rounding error is carried forward, not
   lost: the sum of what was sent over many steps tracks the sum of the true gradients.
2. one ``all_to_all_single``: row ``r`` to rank ``r`` (never summed in the quantized domain);
3. ``zeroc::dequantize_sum_mean(received, sent, ranks, width, bits, block, dtype)``: each
   rank's row dequantized to float32, summed in rank order, divided by the ranks, cast to
   the gradient's dtype.

Per element a row moves ``bits / 8`` bytes plus 4 bytes per block: 3.94x (int8) and 7.76x
(int4) fewer than float32 at ``block`` = 256. A bucket whose quantized rows would not be
smaller (``worth_quantizing``: under about a block per rank) is reduced exact.

The residual of a bucket is as large as the bucket (this rank's whole float32 gradient of
those parameters, every rank's pieces): error feedback costs 4 bytes per parameter element
on every rank, held across steps. It is keyed by a name made when the graph is lowered
(``residual_key``), so each compiled graph has its own; a recompiled graph starts from
zero. ``reset_residuals`` drops them all.
"""

from __future__ import annotations

import itertools
import logging

import torch

from zeroc.runtime.gather_quant import round_half_away

__all__ = ["DEQUANTIZE_SUM_MEAN", "QUANTIZE_GRAD_ROWS", "REDUCE_BITS", "reset_residuals",
           "residual_key", "row_bytes", "worth_quantizing"]

log = logging.getLogger(__name__)

REDUCE_BITS = {"int8": 8, "int4": 4}
_LEVELS = {8: 127, 4: 7}
_RESIDUALS: dict[str, torch.Tensor] = {}
_KEYS = itertools.count()


def residual_key(where: str) -> str:
    """A new error-feedback key for one bucket of one lowered graph (``where``: its name)."""
    return f"{where}#{next(_KEYS)}"


def reset_residuals() -> None:
    """Forget every error-feedback residual (the next reductions start from zero)."""
    _RESIDUALS.clear()


def row_bytes(width: int, bits: int, block: int) -> int:
    """Bytes one quantized row of ``width`` elements takes: the values, then the scales."""
    blocks = -(-width // block)
    return blocks * block * bits // 8 + 4 * blocks


def worth_quantizing(width: int, bits: int, dtype: torch.dtype, block: int) -> bool:
    """Whether a row of ``width`` elements of ``dtype`` moves fewer bytes quantized (a bucket
    under about a block per rank, e.g. a layer norm's, does not: it is reduced exact)."""
    return row_bytes(width, bits, block) < width * dtype.itemsize


def _quantize(values: torch.Tensor, bits: int, block: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``values`` (float32, (n, width)) -> (packed uint8 (n, row_bytes), what the
    packed rows stand for, float32 (n, width))."""
    n, width = values.shape
    blocks = -(-width // block)
    padded = torch.nn.functional.pad(values, (0, blocks * block - width)).view(n, blocks, block)
    scale = padded.abs().amax(2) / _LEVELS[bits]
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    levels = _LEVELS[bits]
    quantized = round_half_away(padded / divisor[..., None]).clamp_(-levels, levels)
    meant = (quantized * scale[..., None]).view(n, blocks * block)[:, :width]
    if bits == 8:
        body = quantized.to(torch.int8).view(torch.uint8).view(n, blocks * block)
    else:  # two values per byte, offset by 8: the low nibble first
        nibbles = (quantized + 8).to(torch.uint8).view(n, blocks * block // 2, 2)
        body = nibbles[..., 0] | (nibbles[..., 1] << 4)
    packed = torch.cat([body, scale.contiguous().view(torch.uint8).view(n, 4 * blocks)], 1)
    return packed, meant


def _dequantize(packed: torch.Tensor, width: int, bits: int, block: int) -> torch.Tensor:
    """Packed rows (uint8, (n, row_bytes)) -> float32 (n, width)."""
    n = packed.shape[0]
    blocks = -(-width // block)
    body_bytes = blocks * block * bits // 8
    scales = packed[:, body_bytes:].contiguous().view(torch.float32)
    body = packed[:, :body_bytes]
    if bits == 8:
        values = body.contiguous().view(torch.int8).float()
    else:
        low = (body & 0xF).float() - 8
        high = (body >> 4).float() - 8
        values = torch.stack([low, high], 2).view(n, blocks * block)
    values = values.view(n, blocks, block) * scales[..., None]
    return values.view(n, blocks * block)[:, :width]


_LIB = torch.library.Library("zeroc", "FRAGMENT")
_LIB.define("quantize_grad_rows(Tensor rows, int ranks, int bits, int block, str key) -> Tensor")
_LIB.define("dequantize_sum_mean(Tensor received, Tensor sent, int ranks, int width, int bits, "
            "int block, ScalarType dtype) -> Tensor")


@torch.library.impl(_LIB, "quantize_grad_rows", "CompositeExplicitAutograd")
def _quantize_grad_rows(rows: torch.Tensor, ranks: int, bits: int, block: int,
                        key: str) -> torch.Tensor:
    values = rows.reshape(ranks, -1).float()
    residual = _RESIDUALS.get(key)
    if residual is not None and residual.shape == values.shape and (
            residual.device == values.device):
        values = values + residual
    packed, meant = _quantize(values, bits, block)
    _RESIDUALS[key] = values - meant
    return packed.reshape(-1)


@torch.library.register_fake("zeroc::quantize_grad_rows", lib=_LIB)
def _quantize_grad_rows_fake(rows: torch.Tensor, ranks: int, bits: int, block: int,
                             key: str) -> torch.Tensor:
    return rows.new_empty(ranks * row_bytes(rows.numel() // ranks, bits, block),
                          dtype=torch.uint8)


@torch.library.impl(_LIB, "dequantize_sum_mean", "CompositeExplicitAutograd")
def _dequantize_sum_mean(received: torch.Tensor, sent: torch.Tensor, ranks: int, width: int,
                         bits: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    del sent  # held until here, as the all-to-all's work holds its input
    values = _dequantize(received.view(ranks, -1), width, bits, block)
    return values.sum(0).div_(ranks).to(dtype)


@torch.library.register_fake("zeroc::dequantize_sum_mean", lib=_LIB)
def _dequantize_sum_mean_fake(received: torch.Tensor, sent: torch.Tensor, ranks: int,
                              width: int, bits: int, block: int,
                              dtype: torch.dtype) -> torch.Tensor:
    return received.new_empty(width, dtype=dtype)


QUANTIZE_GRAD_ROWS = torch.ops.zeroc.quantize_grad_rows.default
DEQUANTIZE_SUM_MEAN = torch.ops.zeroc.dequantize_sum_mean.default
