"""Blockwise int8 quantization of ZeRO parameter gathers (ZeRO++'s qwZ).

With ``options={"gather_quant": "int8"}`` a ZeRO-2/3 all-gather moves a bucket's shards as
int8 values and one float32 scale per block of ``BLOCK`` elements instead of the gather
dtype: per element 1 + 4 / BLOCK bytes (3.94x fewer than float32, 1.97x fewer than bfloat16).
A bucket is quantized as one buffer, so blocks run across its small parameters (a layer
norm's 16-element shard alone would otherwise pay a whole block and scale); a bucket whose
int8 form would not be smaller than its gather dtype (``worth_quantizing``: under about 90
float32 elements) is gathered exact.

- ``zeroc::quantize_int8(shards, block)``: the send buffer, uint8: the bucket's shards one
  after another, as ``nb`` blocks of int8 values (the last zero-padded) followed by the
  ``nb`` float32 scales (as bytes). ``scale = max |x| / 127`` over the block; a value is
  ``round(x / scale)`` (halves away from zero) in [-127, 127], 0 where the block is all zero.
  So ``|x - q * scale| <= scale / 2`` for every element (the error bound the tests check).
- ``zeroc::dequantize_int8(gathered, widths, block, dtype)``: the gathered rank-major packed
  buffers -> in ``dtype``, for each shard width ``w`` in turn, the ``ranks * w`` values rank
  after rank: each parameter's padded flat buffer, contiguous, as the unquantized
  coalesced gather writes it.

The master shard is never quantized in place: only the gathered copy is lossy, and the
gradient of the dequantized weight reaches the exact shard unchanged (a straight-through
estimator, as ZeRO++ does).

Kernels: on CUDA the quantization is one Triton kernel over the concatenated shards (the
bucket's pack) and the dequantization one Triton kernel that writes every parameter's
buffer (its unpack); elsewhere aten ops compute the same values
(``zeroc.runtime.quant.gather_triton``). ``ZEROC_QUANT_KERNEL`` (``auto`` | ``triton`` |
``torch``) overrides the choice; Triton off CUDA needs ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType

import torch

__all__ = ["BLOCK", "KERNEL_ENV", "worth_quantizing", "QUANTIZE_INT8", "DEQUANTIZE_INT8",
           "packed_numel", "quantized_bytes"]

log = logging.getLogger(__name__)

BLOCK = 256  # elements per scale
KERNEL_ENV = "ZEROC_QUANT_KERNEL"
_KERNELS = ("auto", "triton", "torch")


def packed_numel(numel: int, block: int = BLOCK) -> int:
    """Bytes of one shard's packed buffer: the int8 blocks, then a float32 scale per block."""
    blocks = -(-numel // block)
    return blocks * block + 4 * blocks


def worth_quantizing(numel: int, dtype: torch.dtype, block: int = BLOCK) -> bool:
    """Whether a bucket of ``numel`` elements gathered in ``dtype`` moves fewer bytes as
    int8 blocks (a bucket under about a block, e.g. a layer norm's, does not: it is gathered
    exact)."""
    return packed_numel(numel, block) < numel * dtype.itemsize


def quantized_bytes(numel: int, ranks: int, block: int = BLOCK) -> int:
    """Bytes an int8 all-gather of ``ranks`` buckets of ``numel`` elements writes."""
    return ranks * packed_numel(numel, block)


@functools.cache
def _triton_kernels() -> ModuleType | None:
    try:
        return importlib.import_module("zeroc.runtime.quant.gather_triton")
    except ImportError as exc:
        log.debug("zeroc: no Triton kernels for gather_quant (%s)", exc)
        return None


def kernel_for(device: torch.device) -> str:
    """``"triton"`` or ``"torch"``: which implementation quantizes tensors on ``device``."""
    choice = os.environ.get(KERNEL_ENV, "") or "auto"
    if choice not in _KERNELS:
        raise ValueError(f"{KERNEL_ENV}={choice!r}; allowed: {', '.join(_KERNELS)}")
    if choice == "torch":
        return "torch"
    if choice == "auto":
        return "triton" if device.type == "cuda" and _triton_kernels() is not None else "torch"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError(f"{KERNEL_ENV}=triton on a {device.type!r} tensor needs "
                           "TRITON_INTERPRET=1 in the environment before triton is imported")
    if _triton_kernels() is None:
        raise RuntimeError(f"{KERNEL_ENV}=triton, but triton cannot be imported")
    return "triton"


def round_half_away(values: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, halves away from zero (what the Triton kernel does)."""
    return torch.where(values >= 0, torch.floor(values + 0.5), torch.ceil(values - 0.5))


def _quantize_torch(flat: torch.Tensor, block: int) -> torch.Tensor:
    numel = flat.numel()
    blocks = -(-numel // block)
    values = torch.nn.functional.pad(flat.float(), (0, blocks * block - numel))
    values = values.view(blocks, block)
    scale = values.abs().amax(1) / 127
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = round_half_away(values / divisor[:, None]).clamp_(-127, 127).to(torch.int8)
    packed = torch.empty(packed_numel(numel, block), dtype=torch.uint8, device=flat.device)
    packed[: blocks * block].copy_(quantized.view(-1).view(torch.uint8))
    packed[blocks * block :].copy_(scale.view(torch.uint8))
    return packed


def _dequantize_torch(gathered: torch.Tensor, widths: list[int], block: int,
                      dtype: torch.dtype) -> torch.Tensor:
    numel = sum(widths)
    blocks = -(-numel // block)
    rows = gathered.view(-1, packed_numel(numel, block))
    ranks = rows.shape[0]
    values = rows[:, : blocks * block].contiguous().view(torch.int8).view(ranks, blocks, block)
    scales = rows[:, blocks * block :].contiguous().view(torch.float32)
    full = (values.float() * scales[:, :, None]).view(ranks, blocks * block)
    out = torch.empty(ranks * numel, dtype=dtype, device=gathered.device)
    offset = 0
    for width in widths:
        out[ranks * offset : ranks * (offset + width)].view(ranks, width).copy_(
            full[:, offset : offset + width])
        offset += width
    return out


def _ranks(gathered: torch.Tensor, widths: list[int], block: int) -> int:
    per_rank = packed_numel(sum(widths), block)
    if gathered.numel() % per_rank:
        raise ValueError(f"zeroc::dequantize_int8: {gathered.numel()} bytes are not whole "
                         f"ranks of {per_rank} (shards of {widths} elements)")
    return gathered.numel() // per_rank


_LIB = torch.library.Library("zeroc", "FRAGMENT")
_LIB.define("quantize_int8(Tensor[] shards, int block) -> Tensor")
_LIB.define("dequantize_int8(Tensor gathered, int[] widths, int block, ScalarType dtype) "
            "-> Tensor")


def _check_float(shards: list[torch.Tensor]) -> None:
    for shard in shards:
        if not shard.is_floating_point():
            raise TypeError("zeroc: option gather_quant='int8' quantizes floating-point "
                            f"parameters; got a {shard.dtype} shard")


def _joined(shards: list[torch.Tensor]) -> torch.Tensor:
    flats = [s.reshape(-1) for s in shards]
    return flats[0].contiguous() if len(flats) == 1 else torch.cat(flats)


@torch.library.impl(_LIB, "quantize_int8", "CompositeExplicitAutograd")
def _quantize_int8(shards: list[torch.Tensor], block: int) -> torch.Tensor:
    _check_float(shards)
    flat = _joined(shards)
    if kernel_for(flat.device) == "triton":
        return _triton_kernels().quantize(flat, block)
    return _quantize_torch(flat, block)


@torch.library.register_fake("zeroc::quantize_int8", lib=_LIB)
def _quantize_int8_fake(shards: list[torch.Tensor], block: int) -> torch.Tensor:
    _check_float(shards)
    return shards[0].new_empty(packed_numel(sum(s.numel() for s in shards), block),
                               dtype=torch.uint8)


@torch.library.impl(_LIB, "dequantize_int8", "CompositeExplicitAutograd")
def _dequantize_int8(gathered: torch.Tensor, widths: list[int], block: int,
                     dtype: torch.dtype) -> torch.Tensor:
    ranks = _ranks(gathered, widths, block)
    if kernel_for(gathered.device) == "triton":
        return _triton_kernels().dequantize(gathered.contiguous(), ranks, list(widths), block,
                                            dtype)
    return _dequantize_torch(gathered, list(widths), block, dtype)


@torch.library.register_fake("zeroc::dequantize_int8", lib=_LIB)
def _dequantize_int8_fake(gathered: torch.Tensor, widths: list[int], block: int,
                          dtype: torch.dtype) -> torch.Tensor:
    return gathered.new_empty(_ranks(gathered, widths, block) * sum(widths), dtype=dtype)


QUANTIZE_INT8 = torch.ops.zeroc.quantize_int8.default
DEQUANTIZE_INT8 = torch.ops.zeroc.dequantize_int8.default
