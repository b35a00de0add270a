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

Non-finite gradients: a NaN or infinite element is sent as the one code no finite value uses
(-128 in int8, -8 in int4), which the receiver reads as NaN, so the reduced element is NaN
that step, as an exact reduction's would be non-finite; the block's other elements are
quantized as if it were zero (their scale is the finite elements'), and its residual is
zero. A bad step therefore never poisons the residual: it sends and keeps what a step whose
bad elements were zero, and had a zero residual, would, so the next clean step is as if
that element's residual had been reset. All of it is elementwise (no host sync).

Residuals belong to the model (``ResidualStore``, one per parallelized model, kept on its
``ZeroState``: ``store_of``), so they are freed with that state and a new model starts
from zero.
A bucket's residual is named by its parameters' full names (``bucket_id``), so every graph
that reduces the same bucket of the same model (a recompile for new shapes) shares one and
a checkpoint can restore it (``zeroc.ReductionResiduals``). The ops only take strings: a key
is ``<store token>/<bucket id>`` (``ResidualScope.key``), the token found through a
registry of weak references; a key without a token (a graph lowered for no model, the unit
tests) lives in a process-wide store. The residual of a bucket is as large as the bucket
(this rank's whole float32 gradient of those parameters, every rank's pieces): error
feedback costs 4 bytes per parameter element on every rank, held across steps.
``reset_residuals`` drops every live store's; ``residuals_held`` counts them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from zeroc.runtime.quant.gather import round_half_away

__all__ = ["DEQUANTIZE_SUM_MEAN", "OWNER_ATTR", "QUANTIZE_GRAD_ROWS", "REDUCE_BITS",
           "ResidualScope", "ResidualStore", "bucket_id", "owned_key", "reset_residuals",
           "residual_key", "residuals_held", "row_bytes", "store_of", "worth_quantizing"]

log = logging.getLogger(__name__)

REDUCE_BITS = {"int8": 8, "int4": 4}
_LEVELS = {8: 127, 4: 7}
# What every flat buffer of a parallelized model carries: its model's ``ZeroState``
# (``zeroc.sharding.sharded_params.STATE_ATTR``), on which ``store_of`` keeps the residuals.
OWNER_ATTR = "_zeroc_state"
_STORE_ATTR = "_zeroc_residuals"
_TOKENS = itertools.count()
_STORES: weakref.WeakValueDictionary[str, ResidualStore] = weakref.WeakValueDictionary()


class ResidualStore:
    """One model's error-feedback residuals: float32 ``(ranks, width)`` by bucket id.

    ``token`` (``r<n>``, never reused in the process) is how a compiled graph's key finds
    it; the registry holds it weakly, so the residuals go with their owner."""

    def __init__(self) -> None:
        self.token = f"r{next(_TOKENS)}"
        self.residuals: dict[str, torch.Tensor] = {}
        _STORES[self.token] = self

    def key(self, bucket: str) -> str:
        """The op key of ``bucket`` in this store."""
        return f"{self.token}/{bucket}"

    def nbytes(self) -> int:
        """Bytes the residuals hold."""
        return sum(r.numel() * r.element_size() for r in self.residuals.values())

    def __len__(self) -> int:
        return len(self.residuals)

    def clear(self) -> None:
        """Forget every residual (the next reductions start from zero)."""
        self.residuals.clear()

    def state(self) -> dict[str, torch.Tensor]:
        """A copy of the residuals on the host, by bucket id (what a checkpoint saves)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.residuals.items()}

    def load(self, residuals: Mapping[str, torch.Tensor]) -> None:
        """Replace every residual by ``residuals`` (a bucket's moves to its gradients' device
        at its first reduction)."""
        self.residuals = {k: v.detach().float().clone() for k, v in residuals.items()}


_UNOWNED = ResidualStore()  # keys without a token


def store_of(owner: Any) -> ResidualStore:
    """The residual store of ``owner`` (a model's ``ZeroState``), made on first use."""
    store = owner.__dict__.get(_STORE_ATTR)
    if store is None:
        store = owner.__dict__[_STORE_ATTR] = ResidualStore()
    return store


@functools.lru_cache(maxsize=4096)
def bucket_id(params: tuple[str, ...]) -> str:
    """The name of a bucket's residual: its first parameter, how many follow, and a digest
    of every name in order (the same in every process that buckets them alike)."""
    digest = hashlib.sha1("\n".join(params).encode()).hexdigest()[:12]
    first = params[0] if params else ""
    return f"{first}+{max(0, len(params) - 1)}#{digest}"


@dataclasses.dataclass(frozen=True)
class ResidualScope:
    """Where one compiled graph keeps its residuals: the token of its model's store, and the
    full name of each parameter by the name the graph knows it by (a block compiled on its
    own knows ``attn.qkv.weight``, its model ``layers.0.attn.qkv.weight``). Holds no
    reference to the store: a cached graph does not keep a dead model's residuals."""

    token: str
    names: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def key(self, params: Sequence[str]) -> str:
        return f"{self.token}/{bucket_id(tuple(self.names.get(p, p) for p in params))}"


def residual_key(params: Sequence[str], scope: ResidualScope | None = None) -> str:
    """The error-feedback key of a bucket reducing ``params`` (in order) in ``scope``'s
    model; without a scope, a key of the process-wide store."""
    return scope.key(params) if scope is not None else bucket_id(tuple(params))


def owned_key(bucket: str, flat: Any) -> str:
    """``bucket``'s key in the store of the model ``flat`` (one of its flat buffers) belongs
    to; a tensor of no model: the process-wide store's."""
    owner = getattr(flat, OWNER_ATTR, None)
    return bucket if owner is None else store_of(owner).key(bucket)


def _resolve(key: str) -> tuple[ResidualStore | None, str]:
    """The store and bucket id ``key`` names; ``None`` for a model that no longer lives."""
    token, sep, bucket = key.partition("/")
    if not sep:
        return _UNOWNED, key
    store = _STORES.get(token)
    if store is None:
        log.debug("zeroc: reduce_quant: the model of residual %s is gone: not kept", key)
    return store, bucket


def reset_residuals() -> None:
    """Forget every live error-feedback residual (the next reductions start from zero)."""
    for store in list(_STORES.values()):
        store.clear()


def residuals_held() -> tuple[int, int]:
    """``(count, bytes)`` of the residuals every live store of this process holds."""
    stores = list(_STORES.values())
    return sum(len(s) for s in stores), sum(s.nbytes() for s in stores)


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
    packed rows stand for, float32 (n, width): zero where ``values`` is not finite, which
    is sent as the code ``-(L + 1)``)."""
    n, width = values.shape
    blocks = -(-width // block)
    padded = torch.nn.functional.pad(values, (0, blocks * block - width)).view(n, blocks, block)
    finite = padded.isfinite()
    clean = padded.nan_to_num(0.0, 0.0, 0.0)  # a non-finite element counts as zero
    levels = _LEVELS[bits]
    scale = clean.abs().amax(2) / levels
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = round_half_away(clean / divisor[..., None]).clamp_(-levels, levels)
    meant = (quantized * scale[..., None]).view(n, blocks * block)[:, :width]
    quantized = quantized.masked_fill_(~finite, -(levels + 1))
    if bits == 8:
        body = quantized.to(torch.int8).view(torch.uint8).view(n, blocks * block)
    else:  # two values per byte, offset by 8: the low nibble first
        nibbles = (quantized + 8).to(torch.uint8).view(n, blocks * block // 2, 2)
        body = nibbles[..., 0] | (nibbles[..., 1] << 4)
    packed = torch.cat([body, scale.contiguous().view(torch.uint8).view(n, 4 * blocks)], 1)
    return packed, meant


def _dequantize(packed: torch.Tensor, width: int, bits: int, block: int) -> torch.Tensor:
    """Packed rows (uint8, (n, row_bytes)) -> float32 (n, width); NaN where a non-finite
    element was sent."""
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
    values = values.masked_fill_(values == -(_LEVELS[bits] + 1), float("nan"))
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
    store, bucket = _resolve(key)
    residual = store.residuals.get(bucket) if store is not None else None
    if residual is not None and residual.shape != values.shape:
        log.warning("zeroc: reduce_quant: residual %s is %s, the bucket %s (restored from "
                    "another layout?): starting from zero", key, tuple(residual.shape),
                    tuple(values.shape))
    elif residual is not None:
        if residual.device != values.device:  # restored from a checkpoint
            residual = residual.to(values.device)
        values = values + residual
    packed, meant = _quantize(values, bits, block)
    if store is not None:  # never non-finite: zero where this step's element is not
        store.residuals[bucket] = (values - meant).nan_to_num_(0.0, 0.0, 0.0)
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
