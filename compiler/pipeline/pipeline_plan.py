"""The pipeline part of the Plan: per-stage records, the schedule grid, the measured step.

``pipeline_plan(plan, program, executor)`` is called by ``zeroc.explain`` for a session that
compiled a pipelined model: everything here is derived from the frozen ``Program`` that runs
(``zeroc.runtime.program``) and what its executor measured. It replaces the single-device
stage row by one row per stage (modules, parameters, FLOPs and activation bytes per
micro-batch from the program's stage summaries) and adds a
``PipelineInfo``: the schedule drawn as a rank-by-time grid from the simulator with each
stage's own costs, each rank's modelled and measured bubble ratio and its peak activations, and
the last step's action timings for ``plan.chrome_trace``.

Stage costs: once a step has run, the mean measured duration of each stage's F, B (or I + W)
and W actions; before that, the cost model's estimate of each stage's forward (FLOPs plus
bytes moved times ``FLOPS_PER_BYTE``) with B = 2F and W = F. The grid's legend says which, and
the unit of one column.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeroc.passes.front.split_stages import FLOPS_PER_BYTE
from zeroc.runtime.cost.cost import ADAM_STATES
from zeroc.runtime.cost.simulate import ActionCosts, simulate
from zeroc.runtime.mesh import dp_ranks_of
from zeroc.runtime.plan.plan import Plan
from zeroc.runtime.plan.records import MemoryEstimate, PipelineInfo, StageInfo
from zeroc.runtime.plan.schedule_grid import render_grid
from zeroc.runtime.program import Program, StageSummary
from zeroc.runtime.zero_ops import local_rows_for


def _measured_p2p_wait(labels: tuple[tuple[str, ...], ...],
                       times: tuple[tuple[tuple[float, float], ...], ...],
                       waits: tuple[tuple[float, ...], ...]) -> tuple[float, ...]:
    """Per rank, milliseconds of the last step spent posting p2p groups and waiting for the
    receives a compute needed."""
    waits = waits or tuple(() for _ in labels)
    return tuple(1000 * (sum(end - start for label, (start, end) in zip(rank_labels, rank_times,
                                                                        strict=True)
                             if label.startswith(("SEND", "RECV"))) + sum(rank_waits))
                 for rank_labels, rank_times, rank_waits in zip(labels, times, waits,
                                                                strict=True))


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


def _modelled_costs(summaries: tuple[StageSummary, ...]) -> tuple[tuple[float, float, float], ...]:
    """(F, B, W) per stage from the cost model, in units of the cheapest forward."""
    forward = [max(1.0, s.flops + FLOPS_PER_BYTE * s.bytes) for s in summaries]
    unit = min(forward)
    return tuple((f / unit, 2 * f / unit, f / unit) for f in forward)


def _measured_costs(labels: tuple[tuple[str, ...], ...],
                    times: tuple[tuple[tuple[float, float], ...], ...],
                    num_stages: int) -> tuple[tuple[float, float, float], ...] | None:
    """(F, B, W) per stage in milliseconds: mean spans of the last step's single actions."""
    spans: dict[tuple[str, int], list[float]] = {}
    for rank_labels, rank_times in zip(labels, times, strict=True):
        for label, (start, end) in zip(rank_labels, rank_times, strict=True):
            kind, at, stage = label.partition("@s")
            if not at or " " in label or "&" in label or not stage.isdigit():
                continue
            spans.setdefault((kind.rstrip("0123456789"), int(stage)), []).append(
                1000 * (end - start))

    def mean(kind: str, stage: int) -> float | None:
        values = spans.get((kind, stage))
        return sum(values) / len(values) if values else None

    costs = []
    for stage in range(num_stages):
        forward, weight = mean("F", stage), mean("W", stage) or 0.0
        backward = mean("B", stage) or (
            (mean("I", stage) or 0.0) + weight if mean("I", stage) is not None else None)
        if forward is None or backward is None:
            return None
        costs.append((forward, backward, min(weight, backward)))
    return tuple(costs)


def pipeline_info(program: Program, executor: Any) -> PipelineInfo:
    """The ``PipelineInfo`` of a pipelined ``program`` (its compute schedule and stage
    summaries) and the timings ``executor`` (what runs it, or None) measured."""
    schedule, summaries = program.schedule, program.summaries
    assert schedule is not None, "a pipelined Program has a schedule"
    split = False
    if program.pipeline is not None:  # what runs: the lowered schedule's compute actions
        lowered = program.pipeline.schedule
        running = tuple(lowered.compute_actions(r) for r in range(lowered.num_ranks))
        split = running != schedule.actions
        schedule = schedule.replace_actions(running)
    timings = executor.timings if executor is not None else None
    labels = timings.labels if timings is not None else ()
    times = timings.times if timings is not None else ()
    measured = _measured_costs(labels, times, schedule.num_stages) if labels else None
    stage_costs = measured or _modelled_costs(summaries)
    timeline = simulate(schedule, ActionCosts(stages=stage_costs))
    # About 100 columns at most: a column is the shortest action or 1% of the step.
    durations = [t.end - t.start for rank in timeline.ranks for t in rank if t.end > t.start]
    unit = max(min(durations, default=1.0), timeline.makespan / 100)
    legend = ("time unit: ms; stage costs measured in the last step:\n  "
              + ", ".join(f"s{s} F={f:.3g} B={b:.3g} W={w:.3g}"
                          for s, (f, b, w) in enumerate(stage_costs))
              if measured else
              "time unit: the cheapest stage's forward; stage costs from the cost model:\n  "
              + ", ".join(f"s{s} F={f:.3g}" for s, (f, _, _) in enumerate(stage_costs))
              + ", B = 2F, W = F")
    legend += ("\nbubble (model): idle share of the simulated step with these costs; bubble "
               "(measured): idle share\nof the last real step, p2p waits included")
    if split:
        legend += ("\noverlapped pairs run as F, the forward chunk's sends, then B (no "
                   "collective inside\nthe stage graphs to overlap: pp_reshard=False)")
    per_stage = {s.index: s.activation_bytes for s in summaries}
    peak_bytes = []
    for rank in range(schedule.num_ranks):
        stages = [s for s, ranks in enumerate(schedule.placement) if rank in ranks]
        peak_bytes.append(timeline.peak_activations[rank] * max(per_stage[s] for s in stages))
    return PipelineInfo(
        schedule=schedule.name,
        num_ranks=schedule.num_ranks,
        num_stages=schedule.num_stages,
        num_microbatches=schedule.num_microbatches,
        placement=schedule.placement,
        actions=tuple(tuple(str(a) for a in schedule.compute_actions(r))
                      for r in range(schedule.num_ranks)),
        grid=render_grid(schedule, timeline, time_unit=unit) + "\n" + legend,
        bubble_ratios=tuple(timeline.bubble_ratio(r) for r in range(schedule.num_ranks)),
        measured_bubble_ratios=_measured_bubbles(labels, times),
        measured_p2p_wait_ms=_measured_p2p_wait(labels, times,
                                                timings.waits if timings is not None else ()),
        event_waits=timings.waits if timings is not None else (),
        peak_activations=timeline.peak_activations,
        peak_activation_bytes=tuple(peak_bytes),
        event_labels=labels,
        event_times=times,
        stage_costs=stage_costs,
        grid_time_unit=unit,
        grid_legend=legend,
        message_bytes=tuple(s.message_bytes for s in summaries[:-1]),
    )


def _moved_per_step(plan: Plan, microbatches: int) -> int:
    """This rank's collective bytes per step: the step's ZeRO buckets once, collectives inside
    stage graphs once per micro-batch (``pp_reshard``), the optimizer step's once."""
    once = sum(c.bytes for c in plan.collectives
               if c.graph.endswith(".step") or c.graph == "optimizer.step")
    per_microbatch = sum(c.bytes for c in plan.collectives
                         if not (c.graph.endswith(".step") or c.graph == "optimizer.step"))
    return once + microbatches * per_microbatch


def _memory_per_rank(plan: Plan, program: Program,
                     info: PipelineInfo) -> tuple[MemoryEstimate, ...]:
    """One row per global rank: the parameters, gradients and optimizer state of the stages
    its pipeline position holds, its peak activations, and the bytes it moves (measured from
    this rank's collectives, scaled by parameter bytes for the other positions)."""
    layout = program.zero
    if not program.position_params:
        return plan.memory
    mesh = layout.mesh
    own = layout.held_bytes(ADAM_STATES, names=program.position_params[mesh.pp_index])
    moved = _moved_per_step(plan, info.num_microbatches)
    # A data-parallel index's bytes depend on it only through the rows it owns of each
    # sharded first dimension: indices that own the same rows hold the same bytes (all but
    # the last few of a large world), so those bytes are counted once.
    firsts = {r.shape[0]: r.shape for r in layout.params if r.sharded and r.shape}
    rows = []
    for position in range(layout.pp):
        counted: dict[tuple[int, ...], tuple[int, int, int]] = {}
        for dp_index, rank in enumerate(dp_ranks_of(position, layout.pp, layout.dp)):
            owned = tuple(local_rows_for(shape, layout.dp, dp_index) for shape in firsts.values())
            held = counted.get(owned)
            if held is None:
                held = counted[owned] = layout.held_bytes(
                    ADAM_STATES, names=program.position_params[position], dp_index=dp_index)
            activations = info.peak_activation_bytes[position]
            rows.append(MemoryEstimate(
                rank=rank, params=held[0], grads=held[1], optimizer=held[2],
                activations=activations, peak=sum(held) + activations,
                moved=moved if position == mesh.pp_index else
                round(moved * held[0] / own[0]) if own[0] else 0))
    return tuple(rows)


def pipeline_plan(plan: Plan, program: Program, executor: Any) -> Plan:
    """``plan`` with one stage row per pipeline stage, the pipeline section and a memory row
    per rank, from the pipelined ``program`` and what ``executor`` measured."""
    stages = tuple(
        StageInfo(index=s.index, modules=s.units, params=s.params, param_bytes=s.param_bytes,
                  flops=s.flops, activation_bytes=s.activation_bytes,
                  param_names=s.param_names)
        for s in program.summaries)
    assert program.schedule is not None, "a pipelined Program has a schedule"
    meta = dataclasses.replace(plan.meta, schedule=program.schedule.name)
    info = pipeline_info(program, executor)
    return dataclasses.replace(plan, meta=meta, stages=stages, pipeline=info,
                               memory=_memory_per_rank(plan, program, info))
