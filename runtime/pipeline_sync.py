"""The end of a pipeline step: one all-gather of loss shares, action timings and batch digests.

After its last action every rank of a pipeline puts one float64 row together: its share of
the loss, the (start, end, wait) seconds of each of its action groups, and a digest of the
batch it was given (two position-weighted sums per batch input). One all-gather over the
pipeline group hands every rank every row, so every rank returns the same loss (its
data-parallel replica's own: the group is one pipeline, not ``dp``), the plan can draw every
rank's measured timeline (``StepTimings``), and a rank given another batch than its peers
raises on all of them.

``loss_scale`` is 1 / the loss's denominator, from this replica's batch: the graphs return
numerators (see ``zeroc.passes.loss_normalization``); the executor seeds the backwards with
it. Everything that does not change between steps (the labels of every rank's action groups,
the row width, the digest's weights) is made once, when the executor is built.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist

from zeroc.runtime.actions import Action
from zeroc.runtime.mesh import resolve_group
from zeroc.runtime.planning_state import PLANNING

__all__ = ["StepSync", "StepTimings", "group_label"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepTimings:
    """Wall-clock (start, end) seconds of every action group of every rank in the last step."""

    labels: tuple[tuple[str, ...], ...]
    times: tuple[tuple[tuple[float, float], ...], ...]
    # Seconds each group waited, before it started, for receives it needed (per rank).
    waits: tuple[tuple[float, ...], ...] = ()


def group_label(group: tuple[Action, ...]) -> str:
    """A readable name of an action group for traces: ``F3@s1`` or ``SEND_F3@s1->r2 ...``."""
    return " ".join(str(a) for a in group)


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
        self.widths = {train: 3 * max(counts) for train, counts in self.counts.items()}
        self.batch_inputs = tuple(sorted(layout.batch_inputs))
        self.global_ranks = layout.global_ranks
        self.group_name = layout.group_name
        self.layout = layout
        self._weights: dict[tuple[int, torch.device], torch.Tensor] = {}

    def loss_scale(self, inputs: list[Any]) -> float:
        """1 / the loss's denominator for this batch (every rank has the whole batch)."""
        layout = self.layout
        if layout.loss_kind == "micro_mean":
            return 1.0 / layout.schedule.num_microbatches
        if layout.loss_denominator is None or PLANNING.simulated:
            return 1.0  # planning: the denominator's value does not exist (shapes are exact)
        denominator = float(layout.loss_denominator(*inputs))
        if denominator == 0:
            raise ValueError("zeroc pipeline: the loss's denominator is 0 for this batch "
                             "(every target is ignore_index)")
        return 1.0 / denominator

    def digest(self, inputs: list[Any]) -> torch.Tensor:
        """Two position-weighted sums per batch input: equal on ranks given equal batches."""
        if PLANNING.simulated:
            return torch.zeros(2 * len(self.batch_inputs), dtype=torch.float64)
        parts = []
        for index in self.batch_inputs:
            flat = inputs[index].detach().reshape(-1).double()
            key = (flat.numel(), flat.device)
            weights = self._weights.get(key)
            if weights is None:
                weights = torch.arange(flat.numel(), dtype=torch.float64) % 997 + 1
                weights = self._weights[key] = weights.to(flat.device)
            parts += [flat.sum(), (flat * weights).sum()]
        return torch.stack(parts).cpu() if parts else torch.zeros(0, dtype=torch.float64)

    def finish(self, loss: torch.Tensor, seconds: list[float], train: bool, inputs: list[Any],
               scale: float) -> tuple[torch.Tensor, StepTimings | None]:
        """All-gather loss shares, timings and digests; return (the replica's loss, timings).

        ``seconds`` holds three marks per action group: start, compute start (after waiting
        for its receives), end."""
        digest = self.digest(inputs)
        width = self.widths[train]
        device = loss.device
        row = [t for i in range(0, len(seconds), 3)
               for t in (seconds[i + 1], seconds[i + 2], seconds[i + 1] - seconds[i])]
        row += [0.0] * (width - len(row))
        mine = torch.cat([loss.detach().reshape(1).to(torch.float64),
                          torch.tensor(row, dtype=torch.float64).to(device),
                          digest.to(device)])
        group = resolve_group(self.group_name)
        if group is None:
            rows = [mine]
        else:  # on the group's device (CUDA under NCCL), read on the host once
            rows = [torch.empty_like(mine) for _ in range(group.size())]
            dist.all_gather(rows, mine, group=group)
        if PLANNING.simulated:  # fake tensors: no values to read; the plan has no timings
            return (sum(r[0] for r in rows) * scale).float(), None
        values = [r.cpu().tolist() for r in rows]
        counts = self.counts[train]
        timings = StepTimings(
            labels=self.labels[train],
            times=tuple(tuple((v[1 + 3 * i], v[2 + 3 * i]) for i in range(counts[r]))
                        for r, v in enumerate(values)),
            waits=tuple(tuple(v[3 + 3 * i] for i in range(counts[r]))
                        for r, v in enumerate(values)),
        )
        self.check_same_batch([r[1 + width:] for r in rows])
        total = sum(v[0] for v in values)
        return torch.tensor(total * scale, dtype=torch.float32), timings

    def check_same_batch(self, digests: list[torch.Tensor]) -> None:
        """Every rank of a pipeline must run the same batch; raise on all of them if not."""
        odd = [i for i, d in enumerate(digests) if not torch.equal(d, digests[0])]
        if odd:
            ranks = self.global_ranks
            raise ValueError(
                f"zeroc pipeline: the ranks of one pipeline were given different batches "
                f"(rank {ranks[0]} and rank {ranks[odd[0]]} differ): every rank of a pipeline "
                "must pass the same batch. Shard the data over the data-parallel dimension "
                "only, e.g. DistributedSampler(dataset, num_replicas=zeroc.data_parallel_size("
                "model), rank=zeroc.data_parallel_rank(model))")
