"""An evaluation step's per-sample outputs, whole, on every rank of the pipeline.

An evaluation graph (``zeroc.passes.front.loss_output``) keeps the outputs that hold one row per
sample (a language model's logits) after its loss; the last stage returns them for each
micro-batch it runs. ``EvaluationOutputs`` collects them there and, when the step's forwards
are done, makes each output whole on every pipeline position: the rows of the micro-batches a
position ran are sent from it by one broadcast per output over the pipeline's group, in
position order. A schedule runs the last stage on one position (GPipe, 1F1B, ZB1P: the last;
DualPipeV: the first) or two (DualPipe: each direction's last stage), so each output costs one
or two broadcasts per evaluation step; a training step keeps no such outputs.

Every position knows which micro-batches each position runs (the schedule) and every output's
shape and dtype (the layout), so the broadcasts are the same, in the same order, on every
rank: what NCCL needs. The rows are sent as they are, so the outputs equal those a single
process computes for the same micro-batches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zeroc.runtime.actions import Schedule
from zeroc.runtime.mesh import resolve_group
from zeroc.runtime.pipeline import abort as pipeline_abort

__all__ = ["EvaluationOutputs"]


class EvaluationOutputs:
    """Collect the last stage's per-sample outputs of one step; make them whole everywhere."""

    def __init__(self, specs: tuple[tuple[tuple[int, ...], Any], ...], schedule: Schedule,
                 microbatch: int, position: int, global_ranks: tuple[int, ...],
                 group_name: str) -> None:
        self.specs, self.microbatch, self.position = specs, microbatch, position
        self.global_ranks, self.group_name = global_ranks, group_name
        last = schedule.num_stages - 1
        self.sources: dict[int, list[int]] = {}  # position -> its micro-batches, in order
        for m in range(schedule.num_microbatches):
            self.sources.setdefault(schedule.rank_of(last, m), []).append(m)
        self._parts: dict[int, tuple[torch.Tensor, ...]] = {}

    def add(self, microbatch: int, values: tuple[torch.Tensor, ...]) -> None:
        """Keep the outputs the last stage returned for ``microbatch`` (on this position)."""
        self._parts[microbatch] = tuple(v.detach() for v in values)

    def finish(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The step's outputs, whole (``specs``' shapes), on every position; clears the parts."""
        parts, self._parts = self._parts, {}
        group = resolve_group(self.group_name)
        size = self.microbatch
        outputs = []
        for j, (shape, dtype) in enumerate(self.specs):
            whole = torch.empty(shape, dtype=dtype, device=device)
            for source in sorted(self.sources):
                rows = self.sources[source]
                if source == self.position:
                    chunk = torch.cat([parts[m][j] for m in rows]) if len(rows) > 1 \
                        else parts[rows[0]][j].contiguous()
                else:
                    chunk = torch.empty((len(rows) * size, *shape[1:]), dtype=dtype,
                                        device=device)
                if group is not None and len(self.global_ranks) > 1:
                    pipeline_abort.wait(
                        dist.broadcast(chunk, src=self.global_ranks[source], group=group,
                                       async_op=True),
                        device, "an evaluation step's outputs broadcast")
                for k, m in enumerate(rows):
                    whole[m * size:(m + 1) * size] = chunk[k * size:(k + 1) * size]
            outputs.append(whole)
        return tuple(outputs)
