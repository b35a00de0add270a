"""Device memory as a GPU would count it: every allocation a rank makes on its device.

A planned rank's figures (``zeroc.world.fake_world.measured_step``) cover one training step. A GPU
counts everything a rank allocates on it from the start: parameters as ``parallelize`` makes
them, whatever the compile puts on the device, the steps. ``DeviceAllocations`` counts that
in the fake world: a ``TorchDispatchMode`` (``StepMemory``'s bookkeeping: a storage counted
once, when an op first gives it out, freed by a finalizer) entered as the fake world starts
and left when it ends, which keeps

- ``live`` and ``peak`` bytes over the rank's device storages, and ``at_peak``, what was
  alive when the peak was reached (by label, then call site);
- per allocation (``Allocation``) its bytes, shape and dtype, the op that made it (empty
  for a storage made without one), the ``allocation_label`` in effect (``"gather"``,
  ``"gradient"``, ``"graph"``), whether an executor was running a step (``in_step``) and the
  call site: the innermost frame outside torch.

What counts: tensors on ``device`` that are the fake world's own fake tensors (or real
tensors, on a real device). Dynamo and AOTAutograd trace on fake tensors of their own
modes, and a stage is traced on a mode of its own (``zeroc.pipeline.stage_trace``): none of that is
device memory, nor is any op dispatched while a ``make_fx`` trace runs. Storages made
without an op (a planned rank's parameter shards, a replayed graph's outputs) and storages
resized in place (a released parameter) reach it through ``zeroc.runtime.step_memory``'s
``note_made`` / ``note_resized``; a replayed graph's working set through ``note_transient``.

Dynamo runs the original Python instead of the compiled code while a dispatch mode is on the
stack unless the mode is one of torch's infrastructure modes (fake tensors, tracing); this
one calls itself one (``is_infra_mode``, and ``ignore_compile_internals``, which torch
derives from it where it has both), so the compiled program is what it measures. While
Dynamo compiles a frame it sets every dispatch mode aside, the fake world's own included: a
backend that allocated on the device there would make real tensors, which a CPU-only torch
refuses for ``cuda``, so in the fake CUDA world nothing can be allocated on the device
unseen. A pipeline whose batch size Dynamo marked dynamic compiles on its first call, with
the modes in place.

``count_rank`` runs one rank of a job as a user's script would and returns what was counted
(``RankRun``), with the parameters sharded over the data-parallel ranks, whose full size
only a gather may allocate (``full_size`` finds the allocations of that size). The ledger
runs a Python call per op and walks the stack per new storage: a tool for tests and
investigation, not for a training job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from zeroc.runtime import step_memory
from zeroc.runtime.step_memory import (
    StepMemory,
    allocation_label,
    current_label,
    in_step,
    ledgers_active,
)
from zeroc.runtime.torch_compat import FakeTensor, is_traceable_wrapper_subclass, tree_leaves

__all__ = ["Allocation", "DeviceAllocations", "RankRun", "count_rank", "counting", "full_size"]

log = logging.getLogger(__name__)

_TORCH_DIR = os.path.dirname(torch.__file__)
_SKIPPED = (_TORCH_DIR, os.path.abspath(step_memory.__file__), contextlib.__file__)
_THIS = os.path.abspath(__file__)
_GATHER_OPS = ("all_gather",)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One storage a rank allocated on its device."""

    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    op: str  # the op whose output it is ("aten.empty.memory_format"), "" if made without one
    label: str  # the ``allocation_label`` in effect ("gather", "gradient", "graph"), or ""
    in_step: bool  # made while an executor ran a step (inside ``tracking_scope``)
    wrapped: bool  # a tensor subclass's inner tensor (a DTensor's local shard)
    site: str  # the innermost frame outside torch: "runtime/pipeline/zero.py:173 in _gather"

    @property
    def gathered(self) -> bool:
        """Made by a gather: inside one (its output and the unpack of its buffer) or by a
        collective all-gather op."""
        return self.label == "gather" or any(name in self.op for name in _GATHER_OPS)


def _site() -> str:
    """``file:line in function`` of the innermost frame outside torch and this bookkeeping."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_SKIPPED) and (filename != _THIS
                                                  or frame.f_code.co_name == "count_rank"):
            short = "/".join(filename.split(os.sep)[-2:])
            return f"{short}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _plain(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding ``tensor``'s storage: itself, or a wrapper subclass's inner
    tensors (a DTensor's local shard: its op reaches the modes as the DTensor's)."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = [getattr(tensor, name) for name in names]
    return [t for value in inner if isinstance(value, torch.Tensor) for t in _plain(value)]


class DeviceAllocations(StepMemory):
    """Every allocation on ``device`` of the fake tensors of ``fake_mode`` (``None``: real
    tensors) while it is entered: see the module docstring."""

    def __init__(self, device: torch.device | str, fake_mode: Any = None) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.fake_mode = fake_mode
        self.allocations: list[Allocation] = []
        self.at_peak: dict[str, int] = {}
        self._live: dict[int, Allocation] = {}

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True  # Dynamo compiles as usual under it (see the module docstring)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # what an infrastructure mode answers; said so for every torch version

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        if not step_memory.tracing():
            for value in tree_leaves(out):
                if isinstance(value, torch.Tensor):
                    for tensor in _plain(value):
                        if self._counts(tensor):
                            self._add(tensor, str(func), is_traceable_wrapper_subclass(value))
        return out

    def note(self, tensor: torch.Tensor) -> None:
        for plain in _plain(tensor):
            if self._counts(plain):
                self._add(plain, "", is_traceable_wrapper_subclass(tensor))

    def _counts(self, tensor: torch.Tensor) -> bool:
        if tensor.device != self.device:
            return False
        if isinstance(tensor, FakeTensor):
            return tensor.fake_mode is self.fake_mode
        return self.fake_mode is None and not tensor.is_meta

    def _add(self, tensor: torch.Tensor, op: str, wrapped: bool) -> None:
        peak = self.peak
        key = id(tensor.untyped_storage())
        nbytes = self._record(tensor)
        if nbytes is None:
            return
        allocation = Allocation(nbytes=nbytes, shape=tuple(tensor.shape), dtype=tensor.dtype,
                                op=op, label=current_label() or "", in_step=in_step(),
                                wrapped=wrapped, site=_site())
        self.allocations.append(allocation)
        self._live[key] = allocation
        if self.peak > peak:
            self._at_peak()

    def _free(self, key: int) -> None:
        super()._free(key)
        self._live.pop(key, None)

    def alive(self) -> tuple[Allocation, ...]:
        """The allocations alive now."""
        return tuple(self._live.values())

    def raise_peak(self, extra: int) -> None:
        peak = self.peak
        super().raise_peak(extra)
        if self.peak > peak:
            self._at_peak(extra)

    def resized(self, tensor: torch.Tensor) -> None:
        super().resized(tensor)
        key = id(tensor.untyped_storage())
        if key in self._live:  # its bytes now: what it holds is what counts
            self._live[key] = dataclasses.replace(self._live[key],
                                                  nbytes=self._seen.get(key, 0))

    def _at_peak(self, transient: int = 0) -> None:
        where: Counter[str] = Counter()
        for allocation in self._live.values():
            where[allocation.label or ("step" if allocation.in_step else "outside a step")] += (
                allocation.nbytes)
        if transient:
            where["a replayed graph's working set"] += transient
        self.at_peak = dict(where)

    def summary(self, top: int = 8) -> str:
        """Peak and live bytes, what was alive at the peak, and the largest call sites."""
        sites: Counter[str] = Counter()
        for allocation in self.allocations:
            sites[allocation.site] += allocation.nbytes
        lines = [f"device {self.device}: peak {self.peak} B, live {self.live} B, "
                 f"{len(self.allocations)} allocations",
                 "at the peak: " + ", ".join(f"{k} {v} B" for k, v in
                                              sorted(self.at_peak.items(), key=lambda kv: -kv[1]))]
        lines += [f"  {nbytes:>12} B  {site}" for site, nbytes in sites.most_common(top)]
        return "\n".join(lines)


def full_size(allocations: Any, params: dict[str, tuple[tuple[int, ...], int, torch.dtype]],
              any_shape: bool = False) -> list[tuple[str, Allocation]]:
    """The plain ``allocations`` the size of a full parameter, each with that parameter's
    name. ``params``: name -> (full shape, padded numel, dtype it is gathered in). An
    allocation is full-size when it has a parameter's shape and dtype; with ``any_shape``,
    whenever it has its numel or padded numel (a gather's buffer, unpacked row by row; on a
    small model also many an unrelated tensor, such as a shard of another parameter). A
    DTensor's local tensor is its shard, whatever its shape, and is left out."""
    shapes = {(shape, dtype): name for name, (shape, _, dtype) in params.items()}
    numels = {(n, dtype): name for name, (shape, padded, dtype) in params.items()
              for n in (math.prod(shape), padded)}
    found = []
    for a in allocations:
        if a.wrapped:
            continue
        name = shapes.get((a.shape, a.dtype))
        if name is None and any_shape:
            name = numels.get((math.prod(a.shape), a.dtype))
        if name is not None:
            found.append((name, a))
    return found


@contextlib.contextmanager
def counting(device: torch.device | str, fake_mode: Any = None) -> Iterator[DeviceAllocations]:
    """Count every allocation on ``device`` (of ``fake_mode``'s fake tensors) while the block
    runs: enter it right after the fake world (``zeroc.world.fake_world.fake_world``) starts."""
    ledger = DeviceAllocations(device, fake_mode)
    with ledgers_active(ledger), ledger:
        yield ledger
    log.debug("zeroc: %s", ledger.summary())


@dataclasses.dataclass(frozen=True)
class RankRun:
    """What ``count_rank`` counted."""

    ledger: DeviceAllocations
    # name -> (full shape, padded numel, dtype it is gathered in) of every parameter sharded
    # over the data-parallel ranks.
    sharded: dict[str, tuple[tuple[int, ...], int, torch.dtype]]
    # The allocations alive after the last step.
    live_after: tuple[Allocation, ...]

    def full_size(self, allocations: Any = None,
                  any_shape: bool = False) -> list[tuple[str, Allocation]]:
        """The allocations (of the run, or ``allocations``) the size of a full sharded
        parameter (the module's ``full_size``), each with the parameter's name."""
        return full_size(self.ledger.allocations if allocations is None else allocations,
                         self.sharded, any_shape)


def count_rank(model: Any, example_inputs: Any, *, rank: int, world: int, pp: int,
               zero: int = 3, device: str = "cuda", steps: int = 3, no_grad_calls: int = 0,
               options: dict | None = None, mixed_precision: Any = None) -> RankRun:
    """Run global rank ``rank`` of a ``world``-rank job in the fake world, as a user's script
    would (``parallelize``, ``torch.compile``, ``steps`` training steps with AdamW, then
    ``no_grad_calls`` calls under ``torch.no_grad()``), counting every allocation on its
    device from the start."""
    import zeroc
    from zeroc.world.fake_world import (
        _backward_for,
        _fake_inputs,
        fake_world,
        loss_of,
        meta_copy,
        planned_world,
    )

    replica = meta_copy(model)
    planned = planned_world(rank, world, pp, device)
    with fake_world(rank, world, pp, device) as mode, counting(planned.device, mode) as ledger:
        args, kwargs = _fake_inputs(example_inputs, planned.device)
        parallel = zeroc.parallelize(replica, zero=zero, pp=pp, mixed_precision=mixed_precision,
                                     planned_world=planned)
        optimizer = torch.optim.AdamW(parallel.parameters())
        compiled = torch.compile(parallel, backend="zeroc", options=dict(options or {}))
        backward = _backward_for(device)
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(compiled(*args, **kwargs), "count_rank")
            with allocation_label("backward"):
                backward(loss)
            del loss
            with allocation_label("optimizer"):
                optimizer.step()
        live_after = ledger.alive()
        for _ in range(no_grad_calls):
            with torch.no_grad():
                compiled(*args, **kwargs)
        sharded = {s.record.param_name: (tuple(s.record.shape), s.record.padded_numel,
                                         s.spec.param_dtype or s.flat.dtype)
                   for s in parallel.__dict__["_zeroc_state"].params if s.record.sharded}
    return RankRun(ledger=ledger, sharded=sharded, live_after=live_after)
