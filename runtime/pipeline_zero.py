"""ZeRO once per pipeline step: gather a stage's parameters before its first micro-batch and
reduce its gradients after its last backward (torch pipelining's UNSHARD / REDUCE_GRAD).

Inside a stage graph a ZeRO parameter is gathered where it is used and its gradient reduced
where it is complete, so a pipeline step with N micro-batches would gather and reduce N times.
With ``pp_reshard=False`` the compiler takes the ``zeroc::unshard`` of every parameter out of
the stage graphs (``passes/hoist_unshard.py``): the graphs read the full parameter and
return its full gradient. ``StepZero`` then, for this rank's stages,

- ``gather(stage, inputs)``: on the first micro-batch of ``stage``, all-gathers the shards of
  its parameters, packed in buckets of at most ``bucket_mb`` MiB per (group, ZeRO stage,
  dtype), one ``all_gather_into_tensor`` per bucket; the full parameters live until the end
  of the step.
- ``reduce(grads, inputs)``: after the last backward, the full gradients summed over the
  micro-batches (and over the micro-steps without sync before it: ``zeroc.pipeline.pipelined_step``)
  are cast to ``reduce_dtype``, packed rank-major in buckets and reduced once:
  ``reduce_scatter_tensor`` at ZeRO-2/3, ``all_reduce`` for whole parameters; each
  parameter's gradient becomes this rank's shard averaged over the data-parallel ranks, in
  the shard's dtype.

Every step issues ``gather_buckets`` all-gathers and ``reduce_buckets`` reductions, whatever
the number of micro-batches; ``counts`` keeps what the last step issued.

While a ``torch.profiler`` records, each bucket's collective runs inside
``record_function``: ``zeroc/step_gather_s<stage>_<n>`` (the plan's collective names) and
``zeroc/step_reduce_<n>`` (the step reduces every stage's buckets together).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist

from zeroc.runtime.collectives import collective_bytes
from zeroc.runtime.executor import PROFILE_PREFIX, profiling, record
from zeroc.runtime.mesh import resolve_group
from zeroc.runtime.plan.records import CollectiveInfo
from zeroc.runtime.step_memory import allocation_label
from zeroc.runtime.torch_compat import all_gather_single, reduce_scatter_single
from zeroc.runtime.zero_ops import group_size

__all__ = ["HoistedParam", "StepZero"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HoistedParam:
    """A parameter whose ``zeroc::unshard`` was taken out of the stage graphs.

    ``shape``/``numel``: the full parameter; ``zero_stage``: the op stage (0: whole
    parameter, gradients all-reduced; 2, 3: sharded)."""

    index: int
    name: str
    shape: tuple[int, ...]
    numel: int
    group_name: str
    zero_stage: int
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None

    def ranks(self) -> int:
        """How many shards the parameter is cut into (1: whole)."""
        return 1 if self.zero_stage == 0 or not self.group_name else group_size(self.group_name)

    def bucket_key(self, dtype: torch.dtype) -> tuple[str, int, torch.dtype]:
        return (self.group_name, self.zero_stage, dtype)


def _buckets(params: list[tuple[HoistedParam, torch.Tensor]], cap_bytes: float,
             dtype_of) -> list[list[tuple[HoistedParam, torch.Tensor]]]:
    """Consecutive runs of one (group, stage, dtype) of at most ``cap_bytes`` each."""
    buckets: list[list[tuple[HoistedParam, torch.Tensor]]] = []
    key, size = None, 0.0
    for param, tensor in params:
        dtype = dtype_of(param, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or param.bucket_key(dtype) != key or size + nbytes > cap_bytes:
            buckets.append([])
            key, size = param.bucket_key(dtype), 0.0
        buckets[-1].append((param, tensor))
        size += nbytes
    return buckets


class StepZero:
    """Per-step gathers and reductions of one rank's stage parameters (module docstring)."""

    def __init__(self, hoisted: dict[int, HoistedParam],
                 stage_params: dict[int, tuple[int, ...]], bucket_mb: float) -> None:
        self.hoisted = hoisted
        self.stage_params = {s: tuple(i for i in idx if i in hoisted)
                             for s, idx in stage_params.items()}
        self.cap = bucket_mb * 2**20
        self.full: dict[int, torch.Tensor] = {}
        self.counts = {"all_gather": 0, "reduce": 0}
        self._gathered: set[int] = set()
        log.debug("zeroc: ZeRO once per step for %d parameters of stages %s, buckets of %g MiB",
                  len(hoisted), sorted(self.stage_params), bucket_mb)

    def collectives(self, inputs: list[Any], graph: str) -> list[CollectiveInfo]:
        """The per-step collectives this rank issues, as the plan lists them."""
        infos = []
        for stage, indices in sorted(self.stage_params.items()):
            params = [(self.hoisted[i], inputs[i]) for i in indices]
            for kind, dtype_of in (("gather", lambda p, t: p.param_dtype or t.dtype),
                                   ("reduce", lambda p, t: p.reduce_dtype or t.dtype)):
                for n, bucket in enumerate(_buckets(params, self.cap, dtype_of)):
                    first, ranks = bucket[0][0], bucket[0][0].ranks()
                    dtype = dtype_of(*bucket[0])
                    size = torch.empty((), dtype=dtype).element_size()
                    numel = sum(t.numel() for _, t in bucket)
                    if kind == "gather":
                        if ranks == 1:
                            continue
                        op, moved, where = "all_gather", ranks * numel * size, (
                            f"first F of s{stage}", f"first F of s{stage}")
                    else:
                        if not first.group_name or group_size(first.group_name) == 1:
                            continue
                        op = "all_reduce" if ranks == 1 else "reduce_scatter"
                        moved = collective_bytes(op, ranks * numel * size, numel * size)
                        where = (f"last B/W of s{stage}", "end of step")
                    infos.append(CollectiveInfo(
                        name=f"step_{kind}_s{stage}_{n}", graph=graph, op=op,
                        group=first.group_name, params=tuple(p.name for p, _ in bucket),
                        bytes=moved, issued_at=where[0], waited_at=where[1],
                        dtype=str(dtype).removeprefix("torch.")))
        return infos

    def begin(self) -> None:
        """Start a step: nothing is gathered yet."""
        self.full.clear()
        self._gathered.clear()
        self.counts = {"all_gather": 0, "reduce": 0}

    def end(self) -> None:
        """End a step: the full parameters are dropped (RESHARD)."""
        self.full.clear()
        self._gathered.clear()

    def parameter(self, index: int, inputs: list[Any]) -> Any:
        """The value a stage graph reads for input ``index``: full if it was hoisted."""
        return self.full[index] if index in self.hoisted else inputs[index]

    def gather(self, stage: int, inputs: list[Any]) -> None:
        """All-gather ``stage``'s hoisted parameters unless this step already did."""
        if stage in self._gathered:
            return
        self._gathered.add(stage)
        todo = [(self.hoisted[i], inputs[i]) for i in self.stage_params.get(stage, ())
                if i not in self.full]
        buckets = _buckets(todo, self.cap, lambda p, t: p.param_dtype or t.dtype)
        with allocation_label("gather"):  # the full parameters are made here, and only here
            for n, bucket in enumerate(buckets):
                self._gather_bucket(bucket, f"{PROFILE_PREFIX}step_gather_s{stage}_{n}"
                                    if profiling() else "")

    def _gather_bucket(self, bucket: list[tuple[HoistedParam, torch.Tensor]],
                       profile_name: str = "") -> None:
        first = bucket[0][0]
        shards = [t.detach().to(p.param_dtype) if p.param_dtype else t.detach()
                  for p, t in bucket]
        ranks = first.ranks()
        if ranks == 1:  # whole parameters: the graph reads a view of the buffer
            for (param, _), shard in zip(bucket, shards, strict=True):
                self.full[param.index] = shard[:param.numel].view(param.shape)
            return
        widths = [s.numel() for s in shards]
        packed = torch.cat(shards) if len(shards) > 1 else shards[0].contiguous()
        gathered = packed.new_empty(ranks * packed.numel())
        with record(profile_name):
            all_gather_single(gathered, packed, group=resolve_group(first.group_name))
        self.counts["all_gather"] += 1
        rows = gathered.view(ranks, -1)
        offset = 0
        for (param, _), width in zip(bucket, widths, strict=True):
            flat = rows[:, offset:offset + width].reshape(-1)
            offset += width
            self.full[param.index] = flat[:param.numel].view(param.shape)

    def reduce(self, grads: dict[int, torch.Tensor], inputs: list[Any]) -> None:
        """Replace each hoisted full gradient in ``grads`` by this rank's reduced shard."""
        with allocation_label("gradient"):
            self._reduce(grads, inputs)

    def _reduce(self, grads: dict[int, torch.Tensor], inputs: list[Any]) -> None:
        todo = []
        for index in sorted(i for i in grads if i in self.hoisted):
            param = self.hoisted[index]
            grad = grads[index].reshape(-1)
            if param.reduce_dtype is not None:
                grad = grad.to(param.reduce_dtype)
            # The shards are padded row-wise: the full padded size is a shard times the ranks.
            padded = inputs[index].numel() * param.ranks()
            if padded > grad.numel():
                grad = torch.nn.functional.pad(grad, (0, padded - grad.numel()))
            todo.append((param, grad))
        for n, bucket in enumerate(_buckets(todo, self.cap, lambda p, t: t.dtype)):
            name = f"{PROFILE_PREFIX}step_reduce_{n}" if profiling() else ""
            for param, shard in self._reduce_bucket(bucket, name):
                grads[param.index] = shard.to(inputs[param.index].dtype)

    def _reduce_bucket(self, bucket: list[tuple[HoistedParam, torch.Tensor]],
                       profile_name: str = ""):
        first = bucket[0][0]
        ranks = first.ranks()
        dp = group_size(first.group_name) if first.group_name else 1
        group = resolve_group(first.group_name) if first.group_name else None
        if ranks == 1 and dp == 1:  # one data-parallel rank: the sum is the gradient itself
            for param, grad in bucket:
                yield param, grad[:param.numel]
            return
        if ranks == 1:  # whole parameters: all-reduce the concatenation
            packed = torch.cat([g for _, g in bucket])
            if group is not None and dp > 1:
                with record(profile_name):
                    dist.all_reduce(packed, group=group)
                self.counts["reduce"] += 1
            packed.div_(dp)
            offset = 0
            for param, grad in bucket:
                yield param, packed[offset:offset + grad.numel()][:param.numel]
                offset += grad.numel()
            return
        # Rank-major: row r holds every parameter's chunk r, so the scatter hands rank r its
        # chunk of each.
        packed = torch.cat([g.view(ranks, -1) for _, g in bucket], dim=1).reshape(-1)
        shard = packed.new_empty(packed.numel() // ranks)
        with record(profile_name):
            reduce_scatter_single(shard, packed, op=dist.ReduceOp.SUM, group=group)
        self.counts["reduce"] += 1
        shard.div_(dp)
        offset = 0
        for param, grad in bucket:
            width = grad.numel() // ranks
            yield param, shard[offset:offset + width]
            offset += width
