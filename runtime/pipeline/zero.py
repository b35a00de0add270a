"""ZeRO once per pipeline step, overlapped with the step's compute: gather a stage's
parameters ahead of its first micro-batch and reduce its gradients as soon as its last backward
made them (torch pipelining's UNSHARD / REDUCE_GRAD, issued asynchronously).

Inside a stage graph a ZeRO parameter is gathered where it is used and its gradient reduced
where it is complete, so a pipeline step with N micro-batches would gather and reduce N times.
With ``pp_reshard=False`` the compiler takes the ``zeroc::unshard`` of every parameter out of
the stage graphs (``passes/front/hoist_unshard.py``): the graphs read the full parameter and
return its full gradient. ``StepZero`` then, for this rank's stages, in the order a
``ZeroOrder`` gives (made once from this rank's schedule by the executor):

- gathers: the shards of each stage's parameters are packed in buckets of at most
  ``bucket_mb`` MiB per (group, ZeRO stage, dtype), one ``all_gather_into_tensor`` per
  bucket, issued with ``async_op=True`` in the order the stages first run a forward. The
  first ``prefetch`` buckets are issued when the step begins; ``gather(stage)``, at the
  stage's first forward, issues the stage's own buckets and ``prefetch`` more beyond them,
  then waits for its own only: the next stage's gather is in flight while this one computes.
  With ``gather_quant="int8"`` a bucket's shards are quantized together into int8 blocks and
  scales, and dequantized into the gather dtype when the bucket is waited
  (``zeroc.runtime.quant.gather``).
  The full parameters live until the end of the step (RESHARD), as the plan's memory says.
- reductions: after the action group that completes a set of parameters' gradients (the last
  B or W of every stage of this rank reading them), ``reduce_ready`` casts them to
  ``reduce_dtype``, packs them rank-major in buckets and issues one asynchronous
  ``reduce_scatter_tensor`` (ZeRO-1/2/3; on gloo an ``all_to_all_single`` whose received
  rows are summed when waited, ``zeroc.runtime.collectives``) or ``all_reduce`` (ZeRO-0)
  per bucket; the full gradients are dropped then. ``reduce`` at the end of the step waits
  for them (and reduces, blocking, whatever was not issued yet: a step that accumulates
  without sync hands its sum here), and each parameter's gradient becomes this rank's shard
  averaged over the data-parallel ranks, in the shard's dtype (ZeRO-1, whose parameters are
  whole: a whole-size gradient holding this rank's averaged rows, zeros elsewhere). With
  ``reduce_quant`` each bucket's rows are quantized with error feedback, sent by an
  all-to-all on any backend and summed in float32 (``zeroc.runtime.quant.reduce``), the
  residual named by the bucket's parameters in the residual store of their model.

Every rank of a data-parallel group runs the same position's schedule, so each issues the same
collectives in the same order (NCCL's in-order matching). An asynchronous collective's input
and output are held until it is waited for (the caching allocator must not reuse them while the
communication stream reads them). Every step issues ``gather_buckets`` all-gathers and
``reduce_buckets`` reductions, whatever the number of micro-batches; ``counts`` keeps what the
last step issued.

While a ``torch.profiler`` records, each bucket's collective is issued inside
``record_function``: ``zeroc/step_gather_s<stage>_<n>`` and ``zeroc/step_reduce_s<stage>_<n>``
(the plan's collective names).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from zeroc.runtime.collectives import chunk_sum_mean, collective_bytes, reduces_by_all_to_all
from zeroc.runtime.executor import PROFILE_PREFIX, profiling, record
from zeroc.runtime.mesh import resolve_group
from zeroc.runtime.pipeline import abort as pipeline_abort
from zeroc.runtime.pipeline.zero_order import HoistedParam, ZeroOrder, buckets, zero_order
from zeroc.runtime.plan.records import CollectiveInfo
from zeroc.runtime.quant.gather import BLOCK as QUANT_BLOCK
from zeroc.runtime.quant.gather import (
    DEQUANTIZE_INT8,
    QUANTIZE_INT8,
    quantized_bytes,
    worth_quantizing,
)
from zeroc.runtime.quant.reduce import (
    DEQUANTIZE_SUM_MEAN,
    QUANTIZE_GRAD_ROWS,
    REDUCE_BITS,
    bucket_id,
    owned_key,
    row_bytes,
)
from zeroc.runtime.quant.reduce import worth_quantizing as worth_reducing_quantized
from zeroc.runtime.step_memory import allocation_label
from zeroc.runtime.torch_compat import all_gather_single, reduce_scatter_single
from zeroc.runtime.zero_ops import (
    WHOLE_FROM_SHARD,
    group_size,
)

__all__ = ["HoistedParam", "StepZero", "ZeroOrder", "zero_order"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Pending:
    """An issued asynchronous collective, with what it reads and writes (held until waited)."""

    work: Any
    bucket: list[tuple[HoistedParam, torch.Tensor]]
    output: torch.Tensor
    source: torch.Tensor
    divisor: int
    rows: int = 1  # > 1: ``output`` holds an all-to-all's rows for this rank, not summed yet
    bits: int = 0  # reduce_quant: the rows are quantized to this many bits
    width: int = 0  # reduce_quant: elements of this rank's reduced piece


def _wait(work: Any) -> None:
    pipeline_abort.wait(work, None, "a ZeRO collective")  # the step's device (pipeline_abort)


class StepZero:
    """Per-step gathers and reductions of one rank's stage parameters (module docstring)."""

    def __init__(self, hoisted: dict[int, HoistedParam], orders: Mapping[bool, ZeroOrder],
                 bucket_mb: float, prefetch: int = 1, gather_quant: str | None = None,
                 reduce_quant: str | None = None) -> None:
        self.hoisted = hoisted
        self.quantized = gather_quant == "int8"  # gathers move int8 blocks + scales
        self.reduce_quant = reduce_quant
        self.reduce_bits = REDUCE_BITS.get(reduce_quant)  # reductions: quantized rows
        self.orders = orders  # by training (True) or forward-only (False) step
        self.cap = bucket_mb * 2**20
        self.prefetch = max(0, int(prefetch))
        self.full: dict[int, torch.Tensor] = {}
        self.counts = {"all_gather": 0, "reduce": 0}
        self._queue: list[tuple[int, int, list[tuple[HoistedParam, torch.Tensor]]]] = []
        self._issued = 0
        self._gathering: dict[int, list[tuple[Any, list, torch.Tensor, torch.Tensor]]] = {}
        self._done: set[int] = set()
        self._reducing: list[tuple[int, int, _Pending]] = []
        log.debug("zeroc: ZeRO once per step for %d parameters, buckets of %g MiB, %d "
                  "gather buckets prefetched", len(hoisted), bucket_mb, self.prefetch)

    def collectives(self, inputs: list[Any], graph: str) -> list[CollectiveInfo]:
        """The per-step collectives this rank issues in a training step, as the plan lists
        them: the buckets ``begin``/``gather`` and ``reduce_ready`` make, in issue order."""
        order = self.orders[True]
        infos = []
        gather_of = {stage: indices for stage, indices in order.gathers}
        reduce_of: dict[int, list[int]] = {}
        for stage, indices in order.reduces.values():
            reduce_of.setdefault(stage, []).extend(indices)
        for stage in sorted(set(gather_of) | set(reduce_of)):
            for kind, indices, dtype_of in (
                    ("gather", gather_of.get(stage, ()), lambda p, t: p.param_dtype or t.dtype),
                    ("reduce", reduce_of.get(stage, ()), lambda p, t: p.reduce_dtype or t.dtype)):
                params = [(self.hoisted[i], inputs[i]) for i in sorted(indices)]
                for n, bucket in enumerate(buckets(params, self.cap, dtype_of)):
                    first, ranks = bucket[0][0], bucket[0][0].ranks()
                    dtype = dtype_of(*bucket[0])
                    size = torch.empty((), dtype=dtype).element_size()
                    numel = sum(t.numel() for _, t in bucket)
                    if kind == "gather":
                        if ranks == 1:
                            continue
                        op, moved = "all_gather", ranks * numel * size
                        if self._quantizes(bucket):
                            moved = quantized_bytes(numel, ranks)
                        where = (f"before F of s{stage} (prefetch {self.prefetch})",
                                 f"first F of s{stage}")
                    else:
                        if not first.group_name or group_size(first.group_name) == 1:
                            continue
                        pieces = first.reduced_by()
                        op = "all_reduce" if pieces == 1 else "reduce_scatter"
                        padded = numel if pieces == 1 else sum(p.padded_numel() for p, _ in bucket)
                        moved = collective_bytes(op, padded * size, padded // pieces * size)
                        if pieces > 1 and self._reduces_quantized(padded // pieces, dtype):
                            moved = pieces * row_bytes(padded // pieces, self.reduce_bits,
                                                       QUANT_BLOCK)
                            dtype = self.reduce_quant
                        where = (f"last B/W of s{stage}", "end of step")
                    infos.append(CollectiveInfo(
                        name=f"step_{kind}_s{stage}_{n}", graph=graph, op=op,
                        group=first.group_name, params=tuple(p.name for p, _ in bucket),
                        bytes=moved, issued_at=where[0], waited_at=where[1],
                        dtype="int8" if kind == "gather" and self._quantizes(bucket)
                        else str(dtype).removeprefix("torch.")))
        return infos

    # -- gathers ------------------------------------------------------------------------------

    def _quantizes(self, bucket: list[tuple[HoistedParam, torch.Tensor]]) -> bool:
        """Whether ``bucket``'s gather moves int8 blocks (``gather_quant``, where it gains)."""
        first, shard = bucket[0]
        return self.quantized and worth_quantizing(sum(t.numel() for _, t in bucket),
                                                   first.param_dtype or shard.dtype)

    def begin(self, inputs: list[Any], train: bool = True) -> None:
        """Start a step: queue every gather bucket in first-forward order, issue the first
        ``prefetch``."""
        self.full.clear()
        self._done.clear()
        self._gathering.clear()
        self._reducing.clear()
        self.counts = {"all_gather": 0, "reduce": 0}
        self._queue, self._issued = [], 0
        for stage, indices in self.orders[train].gathers:
            params = [(self.hoisted[i], inputs[i]) for i in indices]
            for n, bucket in enumerate(buckets(params, self.cap,
                                                lambda p, t: p.param_dtype or t.dtype)):
                self._queue.append((stage, n, bucket))
        self._issue_until(self.prefetch)

    def _issue_until(self, count: int) -> None:
        """Issue queued gather buckets until ``count`` of them have been issued."""
        with allocation_label("gather"):  # the full parameters are made here, and only here
            while self._issued < min(count, len(self._queue)):
                stage, n, bucket = self._queue[self._issued]
                self._issued += 1
                name = f"{PROFILE_PREFIX}step_gather_s{stage}_{n}" if profiling() else ""
                issued = self._gather_bucket(bucket, name)
                if issued is not None:
                    self._gathering.setdefault(stage, []).append(issued)

    def gather(self, stage: int, inputs: list[Any] | None = None) -> None:
        """Make ``stage``'s hoisted parameters whole (its first forward of the step): issue its
        buckets and ``prefetch`` more, wait for its own."""
        if stage in self._done:
            return
        self._done.add(stage)
        last = max((k for k, (s, _, _) in enumerate(self._queue) if s == stage), default=-1)
        self._issue_until(last + 1 + self.prefetch)
        with allocation_label("gather"):  # the unpacked full parameters
            # Each entry holds the collective's input until the list is dropped, after its wait.
            for work, bucket, rows, _input in self._gathering.pop(stage, ()):
                _wait(work)
                self._unpack_gathered(bucket, rows)

    def _gather_bucket(self, bucket: list[tuple[HoistedParam, torch.Tensor]],
                       profile_name: str = "",
                       ) -> tuple[Any, list, torch.Tensor, torch.Tensor] | None:
        first = bucket[0][0]
        shards = [t.detach().to(p.param_dtype) if p.param_dtype else t.detach()
                  for p, t in bucket]
        ranks = first.ranks()
        if ranks == 1:  # whole parameters: the graph reads a view of each, nothing moves
            for (param, _), shard in zip(bucket, shards, strict=True):
                self.full[param.index] = shard[:param.numel].view(param.shape)
            return None
        if self._quantizes(bucket):  # from the exact shards; dequantized when waited
            shards = [QUANTIZE_INT8([t.detach() for _, t in bucket], QUANT_BLOCK)]
        packed = torch.cat(shards) if len(shards) > 1 else shards[0].contiguous()
        gathered = packed.new_empty(ranks * packed.numel())
        with record(profile_name):
            work = all_gather_single(gathered, packed, group=resolve_group(first.group_name),
                                     async_op=True)
        self.counts["all_gather"] += 1
        return work, bucket, gathered.view(ranks, -1), packed

    def _unpack_gathered(self, bucket: list[tuple[HoistedParam, torch.Tensor]],
                         rows: torch.Tensor) -> None:
        if self._quantizes(bucket):  # every parameter's padded flat buffer, in turn
            first, shard = bucket[0]
            widths = [t.numel() for _, t in bucket]
            joined = DEQUANTIZE_INT8(rows.reshape(-1), widths, QUANT_BLOCK,
                                     first.param_dtype or shard.dtype)
            offset = 0
            for (param, _), width in zip(bucket, widths, strict=True):
                flat = joined[offset : offset + rows.shape[0] * width]
                offset += rows.shape[0] * width
                self.full[param.index] = flat[:param.numel].view(param.shape)
            return
        offset = 0
        for param, shard in bucket:
            width = shard.numel()
            flat = rows[:, offset:offset + width].reshape(-1)
            offset += width
            self.full[param.index] = flat[:param.numel].view(param.shape)

    def end(self) -> None:
        """End a step: the full parameters are dropped (RESHARD); nothing is left in flight."""
        for pending in self._gathering.values():
            for work, *_ in pending:
                _wait(work)
        for _, _, pending in self._reducing:
            _wait(pending.work)
        self.full.clear()
        self._gathering.clear()
        self._reducing.clear()
        self._done.clear()

    def parameter(self, index: int, inputs: list[Any]) -> Any:
        """The value a stage graph reads for input ``index``: full if it was hoisted."""
        return self.full[index] if index in self.hoisted else inputs[index]

    # -- reductions ---------------------------------------------------------------------------

    def _reduces_quantized(self, width: int, dtype: torch.dtype) -> bool:
        """Whether a bucket whose rank pieces hold ``width`` elements is reduced quantized
        (``reduce_quant``, where it gains)."""
        return bool(self.reduce_bits) and worth_reducing_quantized(
            width, self.reduce_bits, dtype, QUANT_BLOCK)

    def reduce_ready(self, position: int, grads: dict[int, torch.Tensor], inputs: list[Any],
                     train: bool = True) -> None:
        """After action group ``position``: issue the reductions of the gradients it
        completed and drop the full gradients from ``grads``."""
        point = self.orders[train].reduces.get(position)
        if point is None:
            return
        stage, indices = point
        with allocation_label("gradient"):
            self._issue_reduce(stage, [i for i in indices if i in grads], grads, inputs)

    def reduce(self, grads: dict[int, torch.Tensor], inputs: list[Any]) -> None:
        """Replace each hoisted full gradient in ``grads`` by this rank's reduced shard: wait
        for the reductions issued during the step, and reduce what is left now."""
        with allocation_label("gradient"):
            left = sorted(i for i in grads if i in self.hoisted)
            if left:
                self._issue_reduce(-1, left, grads, inputs)
            for _, _, pending in self._reducing:
                _wait(pending.work)
                self._unpack_reduced(pending, grads, inputs)
            self._reducing.clear()

    def _issue_reduce(self, stage: int, indices: list[int], grads: dict[int, torch.Tensor],
                      inputs: list[Any]) -> None:
        todo = []
        for index in sorted(indices):
            param = self.hoisted[index]
            grad = grads.pop(index).reshape(-1)
            if param.reduce_dtype is not None:
                grad = grad.to(param.reduce_dtype)
            # Reduce-scattered gradients are padded row-wise to equal pieces.
            padded = param.padded_numel() if param.reduced_by() > 1 else grad.numel()
            if padded > grad.numel():
                grad = torch.nn.functional.pad(grad, (0, padded - grad.numel()))
            todo.append((param, grad))
        label = f"s{stage}_" if stage >= 0 else ""
        for n, bucket in enumerate(buckets(todo, self.cap, lambda p, t: t.dtype)):
            name = f"{PROFILE_PREFIX}step_reduce_{label}{n}" if profiling() else ""
            key = owned_key(bucket_id(tuple(p.name for p, _ in bucket)), inputs[
                bucket[0][0].index]) if self.reduce_bits else None  # the flat's model's store
            self._reducing.append((stage, n, self._reduce_bucket(bucket, name, key)))

    def _reduce_bucket(self, bucket: list[tuple[HoistedParam, torch.Tensor]],
                       profile_name: str = "", residual: str | None = None) -> _Pending:
        first = bucket[0][0]
        ranks = first.reduced_by()
        dp = group_size(first.group_name) if first.group_name else 1
        group = resolve_group(first.group_name) if first.group_name else None
        if ranks == 1:  # whole parameters: all-reduce the concatenation
            packed = torch.cat([g for _, g in bucket])  # a copy: reduced in place
            work = None
            if group is not None and dp > 1:
                with record(profile_name):
                    work = dist.all_reduce(packed, group=group, async_op=True)
                self.counts["reduce"] += 1
            return _Pending(work, bucket, packed, packed, dp)
        # Rank-major: row r holds every parameter's chunk r, so the scatter hands rank r its
        # chunk of each.
        packed = torch.cat([g.view(ranks, -1) for _, g in bucket], dim=1).reshape(-1)
        if group is not None and self._reduces_quantized(packed.numel() // ranks, packed.dtype):
            # reduce_quant: quantized rows, by an all-to-all on any backend
            sent = QUANTIZE_GRAD_ROWS(packed, ranks, self.reduce_bits, QUANT_BLOCK, residual)
            received = torch.empty_like(sent)
            with record(profile_name):
                work = dist.all_to_all_single(received, sent, group=group, async_op=True)
            self.counts["reduce"] += 1
            return _Pending(work, bucket, received, sent, dp, rows=ranks,
                            bits=self.reduce_bits, width=packed.numel() // ranks)
        if group is not None and reduces_by_all_to_all(group, packed.device):
            # gloo: row r to rank r, the rows received summed when waited (half the bytes
            # of gloo's reduce_scatter_tensor, an all-reduce)
            received = torch.empty_like(packed)
            with record(profile_name):
                work = dist.all_to_all_single(received, packed, group=group, async_op=True)
            self.counts["reduce"] += 1
            return _Pending(work, bucket, received, packed, dp, rows=ranks)
        shard = packed.new_empty(packed.numel() // ranks)
        with record(profile_name):
            work = reduce_scatter_single(shard, packed, op=dist.ReduceOp.SUM, group=group,
                                         async_op=True)
        self.counts["reduce"] += 1
        return _Pending(work, bucket, shard, packed, dp)

    def _unpack_reduced(self, pending: _Pending, grads: dict[int, torch.Tensor],
                        inputs: list[Any]) -> None:
        first = pending.bucket[0][0]
        shard, ranks = pending.output, first.reduced_by()
        if pending.bits:  # quantized rows: dequantized, summed in float32, averaged
            shard = DEQUANTIZE_SUM_MEAN(shard, pending.source, pending.rows, pending.width,
                                        pending.bits, QUANT_BLOCK, pending.bucket[0][1].dtype)
        elif pending.rows > 1:  # an all-to-all's rows: summed, then averaged
            shard = chunk_sum_mean(shard, pending.rows)
        elif pending.divisor > 1:
            shard.div_(pending.divisor)
        offset = 0
        for param, grad in pending.bucket:
            width = grad.numel() // ranks
            value = shard[offset:offset + width]
            offset += width
            if ranks == 1:
                value = value[:param.numel]
            elif param.zero_stage == 1:  # whole parameters: the rows in a whole-size gradient
                value = WHOLE_FROM_SHARD(value, param.numel, param.group_name)
            grads[param.index] = value.to(inputs[param.index].dtype)
