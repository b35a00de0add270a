"""The end of a pipeline step: one all-gather of loss shares, action timings and batch digests.

After its last action every rank of a pipeline puts one float64 row together on the step's
device: its share of the loss, the loss's denominator, the (start, end, wait) seconds of
each action group of its latest timed step (``StepClock``), and a digest of the batch it was
given (two position-weighted sums per batch input). One all-gather over the pipeline group
hands every rank every row, so every rank returns the same loss (its data-parallel
replica's own: the group is one pipeline, not ``dp``), computed on the device.

Nothing of a step is read on the host while the step runs: the gathered rows are copied to
the host without blocking, and read when the next pipelined call ends (of any pipeline of
the process: every rank of a pipeline makes the same calls, so all of them read, and raise,
at the same point), or when the plan asks for the timings. Reading them then checks that
every rank of the pipeline was given the same batch and that the loss's denominator was not
0, and keeps every rank's timings for the plan's measured timeline (``StepTimings``).

When the host waits, on a CUDA device: at the end of call N, after its actions were queued
and before its own all-gather, ``read_rows`` waits (one ``Event.synchronize``) for the event
recorded after call N-1's rows were copied, and only if the device has not reached it yet,
that is while the device still runs call N-1. Call N is queued on the device by then, so the
wait never leaves the device idle: it keeps the host at most one call ahead of the device,
and it is what makes every rank read, and raise on, call N-1's rows at the same point (a rank
that read only what had arrived could raise a call later than its peers and leave them in a
collective). The timings never wait (``StepClock``); nothing waits on the CPU, where the
rows are on the host when the all-gather returns.

``loss_scale`` is 1 / the loss's denominator from this replica's batch: the graphs return
numerators (see ``zeroc.passes.front.loss_normalization``); the executor seeds the backwards with
it. A denominator computed from the batch (a count of targets) stays a device tensor; where
it is 0 the step's loss is NaN and its backward is seeded with 0, and the error comes when
the rows are read. Everything that does not change between steps (the labels of every
rank's action groups, the row layout, the digest's weights) is made once.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist

from zeroc.runtime.actions import Action
from zeroc.runtime.mesh import resolve_group
from zeroc.runtime.pipeline import abort as pipeline_abort
from zeroc.runtime.step_clock import StepClock, host_row
from zeroc.runtime.torch_compat import FakeTensor

__all__ = ["LossScale", "StepSync", "StepTimings", "group_label", "read_rows"]

log = logging.getLogger(__name__)

# Row layout: loss share, denominator, timing kind (1 train, 0 forward-only, -1 none), then
# the timings (three per action group, padded) and the digest.
_LOSS, _DENOMINATOR, _KIND, _TIMES = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class StepTimings:
    """Wall-clock (start, end) seconds of every action group of every rank in a step."""

    labels: tuple[tuple[str, ...], ...]
    times: tuple[tuple[tuple[float, float], ...], ...]
    # Seconds each group waited, before it started, for receives it needed (per rank).
    waits: tuple[tuple[float, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class LossScale:
    """1 / the loss's denominator for one step: a float, or 0-d float64 tensors on the step's
    device when the batch gives the denominator. ``tangent_value`` is 0 where it is 0."""

    value: float | torch.Tensor
    tangent_value: float | torch.Tensor
    denominator: float | torch.Tensor

    def tangent(self, device: torch.device) -> torch.Tensor:
        """A fresh 0-d tensor of the default dtype: a micro-batch backward's seed."""
        if isinstance(self.tangent_value, torch.Tensor):
            return self.tangent_value.to(torch.get_default_dtype(), copy=True)
        return torch.full((), self.tangent_value, device=device)


def group_label(group: tuple[Action, ...]) -> str:
    """A readable name of an action group for traces: ``F3@s1`` or ``SEND_F3@s1->r2 ...``."""
    return " ".join(str(a) for a in group)


@dataclasses.dataclass
class _Gathered:
    """One call's gathered rows, on their way to the host."""

    sync: StepSync
    host: torch.Tensor  # (ranks, row) float64; a non-blocking copy while ``ready`` is pending
    ready: Any  # a CUDA event recorded after the copy, or None (already on the host)


_UNREAD: list[_Gathered] = []  # every pipeline's calls whose rows were not read yet, in order


def read_rows(wait: bool, when: str) -> None:
    """Read the gathered rows of earlier calls (oldest first): check them and keep their
    timings. ``wait``: wait for rows the device has not copied yet (else leave them); the
    one host wait of a pipelined call (module docstring)."""
    while _UNREAD:
        entry = _UNREAD[0]
        if entry.ready is not None and not entry.ready.query():
            if not wait:
                return
            entry.ready.synchronize()
        _UNREAD.pop(0)
        entry.sync.read(entry.host.tolist(), when)


_FOLD = 1 << 52
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(flat: torch.Tensor) -> torch.Tensor:
    """``flat``'s elements as the integers of their bit patterns (int64)."""
    if flat.dtype == torch.bool:
        return flat.to(torch.int64)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.contiguous().view(_BITS[flat.element_size()]).to(torch.int64)


class StepSync:
    """The closing all-gather of one pipeline executor (see the module docstring)."""

    def __init__(self, groups: dict[bool, list[list[tuple[Action, ...]]]],
                 layout: Any) -> None:
        """``groups``: every rank's action groups (training, forward-only); ``layout``: the
        executor's ``PipelineLayout``."""
        self.labels = {train: tuple(tuple(group_label(g) for g in rank_groups)
                                    for rank_groups in rank_lists)
                       for train, rank_lists in groups.items()}
        self.counts = {train: tuple(len(g) for g in rank_lists)
                       for train, rank_lists in groups.items()}
        self.width = 3 * max(max(counts) for counts in self.counts.values())
        self.batch_inputs = tuple(sorted(layout.batch_inputs))
        self.global_ranks = layout.global_ranks
        self.group_name = layout.group_name
        self.layout = layout
        self.timings: StepTimings | None = None
        self._weights: dict[tuple[int, torch.device], torch.Tensor] = {}

    def loss_scale(self, inputs: list[Any], device: torch.device) -> LossScale:
        """1 / the loss's denominator for this batch (every rank has the whole batch)."""
        layout = self.layout
        if layout.loss_kind == "micro_mean":
            count = float(layout.schedule.num_microbatches)
            return LossScale(1.0 / count, 1.0 / count, count)
        if layout.loss_denominator is None:
            return LossScale(1.0, 1.0, 1.0)
        denominator = layout.loss_denominator(*inputs)
        if isinstance(denominator, torch.Tensor):  # from the batch: stays on the device
            value = denominator.detach().to(torch.float64).reshape(())
            scale = value.reciprocal()
            return LossScale(scale, torch.where(value == 0, 0.0, scale), value)
        if float(denominator) == 0:
            raise ValueError("zeroc pipeline: the loss's denominator is 0 for this batch "
                             "(every target is ignore_index)")
        return LossScale(1.0 / float(denominator), 1.0 / float(denominator),
                         float(denominator))

    def digest(self, inputs: list[Any], device: torch.device) -> torch.Tensor:
        """Two position-weighted sums per batch input of its bit patterns (so NaN equals
        NaN, and -0.0 differs from 0.0): equal on ranks given equal batches."""
        parts = []
        for index in self.batch_inputs:
            flat = _bits(inputs[index].detach().reshape(-1))
            key = (flat.numel(), flat.device)
            weights = self._weights.get(key)
            if weights is None:
                weights = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device)
                weights = self._weights[key] = weights % 997 + 1
            # int64 sums wrap alike on every rank; folded below 2**52 they are exact doubles.
            parts += [flat.sum() % _FOLD, (flat * weights).sum() % _FOLD]
        return (torch.stack(parts).to(device=device, dtype=torch.float64) if parts
                else torch.zeros(0, dtype=torch.float64, device=device))

    def finish(self, loss: torch.Tensor, clock: StepClock, train: bool, inputs: list[Any],
               scale: LossScale) -> torch.Tensor:
        """Read earlier calls' rows, then all-gather this step's; return the replica's loss
        (on the device, float32). ``clock`` has this step's marks."""
        read_rows(wait=True, when="the previous call")
        device = loss.device
        latest = clock.latest()
        timing = [-1.0] + [0.0] * self.width
        if latest is not None:
            kind, seconds = latest
            timing = [float(kind)] + [t for i in range(0, len(seconds), 3) for t in (
                seconds[i + 1], seconds[i + 2], seconds[i + 1] - seconds[i])]
            timing += [0.0] * (1 + self.width - len(timing))
        denominator = scale.denominator
        if not isinstance(denominator, torch.Tensor):
            denominator = torch.full((), denominator, dtype=torch.float64, device=device)
        mine = torch.cat([loss.detach().reshape(1).to(torch.float64),
                          denominator.reshape(1).to(device),
                          host_row(timing, device, pinned=clock.events),
                          self.digest(inputs, device)])
        group = resolve_group(self.group_name)
        if group is None:
            gathered = mine.reshape(1, -1)
        else:  # on the group's device (CUDA under NCCL)
            rows = [torch.empty_like(mine) for _ in range(group.size())]
            pipeline_abort.wait(dist.all_gather(rows, mine, group=group, async_op=True),
                                mine.device, "the step's closing all-gather")
            gathered = torch.stack(rows)
        if isinstance(gathered, FakeTensor):
            pass  # a planned step: there are no values to read later
        elif not clock.events:  # on the host (the CPU): read as they are
            _UNREAD.append(_Gathered(self, gathered, None))
        else:  # CUDA: a copy that does not block, and the event read_rows waits for
            host = gathered.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            _UNREAD.append(_Gathered(self, host, ready))
        return (gathered[:, _LOSS].sum() * scale.value).to(torch.float32)

    def read(self, rows: list[list[float]], when: str) -> None:
        """Check one call's gathered rows (same batch, denominator not 0) and keep their
        timings; ``when`` names the call in the errors."""
        start = _TIMES + self.width
        self.check_same_batch([r[start:] for r in rows], when)
        if any(r[_DENOMINATOR] == 0 for r in rows):
            raise ValueError(
                f"zeroc pipeline: the loss's denominator was 0 for the batch of {when} "
                "(every target is ignore_index): that call returned a NaN loss and seeded its "
                "backward with 0. Each call's denominator is checked when the next one ends, "
                "so that no step waits for the device")
        kinds = [r[_KIND] for r in rows]
        if any(k < 0 for k in kinds):
            return  # some rank had no timed step yet: keep the previous timings
        labels, times, waits = [], [], []
        for rank, (kind, row) in enumerate(zip(kinds, rows, strict=True)):
            train = kind > 0
            count = self.counts[train][rank]
            labels.append(self.labels[train][rank])
            times.append(tuple((row[_TIMES + 3 * i], row[_TIMES + 1 + 3 * i])
                               for i in range(count)))
            waits.append(tuple(row[_TIMES + 2 + 3 * i] for i in range(count)))
        self.timings = StepTimings(labels=tuple(labels), times=tuple(times),
                                   waits=tuple(waits))

    def check_same_batch(self, digests: list[list[float]], when: str) -> None:
        """Every rank of a pipeline must run the same batch; raise on all of them if not."""
        odd = [i for i, d in enumerate(digests) if d != digests[0]]
        if odd:
            ranks = self.global_ranks
            raise ValueError(
                f"zeroc pipeline: the ranks of one pipeline were given different batches in "
                f"{when} (rank {ranks[0]} and rank {ranks[odd[0]]} differ; each call's batches "
                "are compared when the next one ends, so that no step waits for the device): "
                "every rank of a pipeline must pass the same batch. Shard the data over the "
                "data-parallel dimension only, e.g. DistributedSampler(dataset, num_replicas="
                "zeroc.data_parallel_size(model), rank=zeroc.data_parallel_rank(model))")
