"""The pipeline part of the Plan: per-stage records, the schedule grid, the measured step.

``pipeline_plan(plan, record)`` is called by ``zeroc.explain`` for a session that compiled a
pipelined model. It replaces the single-device stage row by one row per stage (modules,
parameters, FLOPs and activation bytes per micro-batch from the split) and adds a
``PipelineInfo``: the schedule drawn as a rank-by-time grid from the simulator (F=1, B=2,
W=1, F&B=F+B), each rank's modelled and measured bubble ratio and its peak activations, and the
last step's action timings for ``plan.chrome_trace``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeroc.runtime.plan import Plan
from zeroc.runtime.records import PipelineInfo, StageInfo
from zeroc.runtime.schedule_grid import render_grid
from zeroc.runtime.simulate import ActionCosts, simulate


def _measured_bubbles(labels: tuple[tuple[str, ...], ...],
                      times: tuple[tuple[tuple[float, float], ...], ...]) -> tuple[float, ...]:
    """Per rank, the fraction of the step (earliest start to latest end) not computing."""
    spans = [t for rank in times for t in rank]
    if not spans:
        return ()
    makespan = max(end for _, end in spans) - min(start for start, _ in spans)
    ratios = []
    for rank_labels, rank_times in zip(labels, times, strict=True):
        busy = sum(end - start for label, (start, end) in zip(rank_labels, rank_times,
                                                               strict=True)
                   if not label.startswith(("SEND", "RECV")))
        ratios.append(max(0.0, 1.0 - busy / makespan) if makespan > 0 else 0.0)
    return tuple(ratios)


def pipeline_info(record: Any) -> PipelineInfo:
    """Freeze a ``PipelineRecord`` (schedule, split, executor) into a ``PipelineInfo``."""
    schedule, split = record.schedule, record.split
    timeline = simulate(schedule, ActionCosts())
    per_stage = {s.index: s.activation_bytes for s in split.stages}
    peak_bytes = []
    for rank in range(schedule.num_ranks):
        stages = [s for s, ranks in enumerate(schedule.placement) if rank in ranks]
        peak_bytes.append(timeline.peak_activations[rank] * max(per_stage[s] for s in stages))
    timings = record.executor.timings
    labels = timings.labels if timings is not None else ()
    times = timings.times if timings is not None else ()
    return PipelineInfo(
        schedule=schedule.name,
        num_ranks=schedule.num_ranks,
        num_stages=schedule.num_stages,
        num_microbatches=schedule.num_microbatches,
        placement=schedule.placement,
        actions=tuple(tuple(str(a) for a in schedule.compute_actions(r))
                      for r in range(schedule.num_ranks)),
        grid=render_grid(schedule, timeline),
        bubble_ratios=tuple(timeline.bubble_ratio(r) for r in range(schedule.num_ranks)),
        measured_bubble_ratios=_measured_bubbles(labels, times),
        peak_activations=timeline.peak_activations,
        peak_activation_bytes=tuple(peak_bytes),
        event_labels=labels,
        event_times=times,
    )


def pipeline_plan(plan: Plan, record: Any) -> Plan:
    """``plan`` with one stage row per pipeline stage and the pipeline section."""
    stages = tuple(
        StageInfo(index=s.index, modules=s.units, params=record.stage_params[s.index],
                  param_bytes=record.stage_param_bytes[s.index], flops=s.flops,
                  activation_bytes=s.activation_bytes)
        for s in record.split.stages)
    meta = dataclasses.replace(plan.meta, schedule=record.schedule.name)
    return dataclasses.replace(plan, meta=meta, stages=stages, pipeline=pipeline_info(record))
