"""Triton kernels of ``zeroc::quantize_int8`` / ``zeroc::dequantize_int8``
(``zeroc.runtime.quant.gather``): one program per block of ``BLOCK`` elements.

Quantize: a program loads its block of the bucket's joined shards (float32 arithmetic),
takes ``max |x|``, writes the int8 values (``x / scale`` rounded half away from zero, clamped
to [-127, 127]) into the packed buffer's block bytes and the scale into the scale region,
read as float32. The dequantize program of (rank, block) reads that rank's packed row and
writes ``q * scale`` in the output's dtype where each element belongs: element ``k`` of
shard ``i`` (bucket offsets ``lo <= k < hi``) of rank ``r`` goes to
``ranks * lo + r * (hi - lo) + (k - lo)``, so every parameter's gathered buffer is
contiguous. The packed layout (``nb * block`` value bytes, then ``nb`` float32 scales, per
rank) keeps every scale 4-byte aligned, since ``block`` is a multiple of 4.

This module imports ``triton`` at the top; ``zeroc.runtime.quant.gather`` imports it on
first use only. Off CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from zeroc.runtime.quant.gather import packed_numel

__all__ = ["dequantize", "quantize"]


@triton.jit
def _quantize_kernel(x_ptr, values_ptr, scales_ptr, numel, BLOCK: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0).to(tl.float32)
    scale = tl.max(tl.abs(x), axis=0) / 127.0
    divisor = tl.where(scale > 0, scale, 1.0)
    ratio = x / divisor
    rounded = tl.where(ratio >= 0, tl.floor(ratio + 0.5), tl.ceil(ratio - 0.5))
    rounded = tl.minimum(tl.maximum(rounded, -127.0), 127.0)
    tl.store(values_ptr + offsets, rounded.to(tl.int8))
    tl.store(scales_ptr + block, scale)


@triton.jit
def _dequantize_kernel(packed_ptr, scales_ptr, out_ptr, offsets_ptr, shards, ranks, numel,
                       blocks, row_bytes, BLOCK: tl.constexpr):
    rank = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    values = tl.load(packed_ptr + rank * row_bytes + block * BLOCK + lanes).to(tl.float32)
    scale = tl.load(scales_ptr + (rank * row_bytes + blocks * BLOCK) // 4 + block)
    within = block * BLOCK + lanes
    dest = within * 0
    for shard in range(0, shards):  # the few parameters of one bucket
        lo = tl.load(offsets_ptr + shard)
        hi = tl.load(offsets_ptr + shard + 1)
        inside = (within >= lo) & (within < hi)
        dest = tl.where(inside, ranks * lo + rank * (hi - lo) + (within - lo), dest)
    tl.store(out_ptr + dest, (values * scale).to(out_ptr.dtype.element_ty), mask=within < numel)


@functools.lru_cache(maxsize=4096)
def _offsets(widths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The shards' bucket offsets on ``device``, made once per bucket (not a copy per step)."""
    return torch.tensor([0, *widths], dtype=torch.int64).cumsum(0).to(device)


def quantize(shard: torch.Tensor, block: int) -> torch.Tensor:
    """``shard`` (1-D, contiguous: a bucket's joined shards) -> its packed int8 buffer."""
    numel = shard.numel()
    blocks = -(-numel // block)
    packed = torch.empty(packed_numel(numel, block), dtype=torch.uint8, device=shard.device)
    values = packed[: blocks * block].view(torch.int8)
    scales = packed[blocks * block :].view(torch.float32)
    if blocks:
        _quantize_kernel[(blocks,)](shard, values, scales, numel, BLOCK=block)
    return packed


def dequantize(gathered: torch.Tensor, ranks: int, widths: list[int], block: int,
               dtype: torch.dtype) -> torch.Tensor:
    """Rank-major packed buffers -> each shard's ``ranks * width`` values in ``dtype``."""
    numel = sum(widths)
    blocks = -(-numel // block)
    out = torch.empty(ranks * numel, dtype=dtype, device=gathered.device)
    offsets = _offsets(tuple(widths), gathered.device)
    if blocks and ranks:
        _dequantize_kernel[(ranks, blocks)](
            gathered.view(torch.int8), gathered.view(torch.float32), out, offsets, len(widths),
            ranks, numel, blocks, packed_numel(numel, block), BLOCK=block)
    return out
