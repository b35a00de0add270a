"""The step time of a planned job, estimated from a hardware profile.

``estimate_step(plans, world, profile, dtype)`` takes the plan of every pipeline position
(``zeroc.world_plan``) and models one training step on ``profile``
(``zeroc.runtime.hardware``):

- compute: every compiled graph as a roofline, ``max(FLOPs / peak(dtype), bytes / memory
  bandwidth)``, at least the launch floor. Pipelines: each stage's F, B and W from its own
  graphs (``g0.s3.forward``, ``.backward`` or ``.input_grad`` + ``.weight_grad``), run
  through the schedule simulator (``zeroc.runtime.simulate``), so the bubble is the one of this
  schedule with these costs; one rank's step is the simulated makespan.
- communication: each collective from its bytes, its group size and a ring model (latency +
  bytes / link bandwidth; inter-node links when the data-parallel group spans more devices
  than a node has). Collectives inside graphs are taken as overlapped with the compute they
  run beside (only what exceeds it is exposed); the once-per-step ZeRO gathers and reductions
  of a pipeline (``g0.step``) and the optimizer step's are exposed in full. A pipeline's p2p
  transfer (the largest message between two stages, ``PipelineInfo.message_bytes``: latency +
  bytes / link bandwidth, inter-node links when a pipeline position spans a node) delays
  every dependency that crosses ranks in the simulation.
- the optimizer: AdamW reads and writes 28 bytes per fp32 element a rank holds (parameter,
  gradient, two moments), at memory bandwidth.

A rank's step is the sum; the job's step is its slowest position's. The estimate also gives
every graph's time per call (``StepEstimate.graphs``) and the slowest rank's step by action
kind (``StepEstimate.kinds``: the pipeline's F, B, I, W and F&B actions, or the forward and
backward graphs, then p2p, exposed collectives and the optimizer).
"""

from __future__ import annotations

from typing import Any

from zeroc.passes.schedule import build_schedule
from zeroc.runtime.hardware import estimate_collective_s, estimate_compute_s
from zeroc.runtime.records import StepEstimate
from zeroc.runtime.simulate import ActionCosts, simulate

__all__ = ["estimate_step"]

ADAMW_BYTES_PER_ELEMENT = 28  # read p, g, m, v and write p, m, v: 7 fp32 values


def _graph_s(graph: Any, dtype: str, profile: Any) -> float:
    """A graph's compute time: the roofline of every node that does work (FLOPs or bytes),
    each at least the profile's launch floor (on a CPU or for small ops the floor is most of
    the time); a graph without node costs as one roofline."""
    working = [c for c in getattr(graph, "node_costs", ()) if c.flops or c.bytes]
    if not working:
        return estimate_compute_s(graph.flops, graph.bytes, dtype, profile)
    return sum(estimate_compute_s(c.flops, c.bytes, dtype, profile) for c in working)


def _stage_costs(plans: list[Any], num_stages: int, dtype: str,
                 profile: Any) -> tuple[tuple[float, float, float], ...]:
    """(F, B, W) seconds per stage, from the stage graphs of whichever position holds it."""
    graphs = {g.name.split(".", 1)[1]: g for plan in plans for g in plan.graphs
              if g.name.count(".") >= 2}
    costs = []
    for stage in range(num_stages):
        def seconds(kind: str, stage: int = stage) -> float:
            graph = graphs.get(f"s{stage}.{kind}")
            return _graph_s(graph, dtype, profile) if graph is not None else 0.0

        forward = seconds("forward")
        weight = seconds("weight_grad")
        backward = seconds("backward") or (seconds("input_grad") + weight) or 2 * forward
        costs.append((forward, backward, min(weight, backward) if weight else backward / 2))
    return tuple(costs)


def _collective_s(plan: Any, dp: int, profile: Any, inter_node: bool,
                  once: bool) -> float:
    total = 0.0
    for c in plan.collectives:
        at_step = c.graph.endswith(".step") or c.graph == "optimizer.step"
        if at_step != once:
            continue
        kind = c.op if c.op in ("all_gather", "reduce_scatter") else "all_reduce"
        # zeroc's byte accounting: a gather / reduce-scatter of X moves X, an all-reduce 2X.
        nbytes = c.bytes if kind != "all_reduce" else c.bytes // 2
        total += estimate_collective_s(kind, nbytes, dp, profile, inter_node)
    return total


def _p2p_s(info: Any, dp: int, profile: Any) -> float:
    """One stage-to-stage transfer: the largest message, on the links between neighbouring
    positions (``dp`` ranks apart: another node when a position fills one)."""
    largest = max(getattr(info, "message_bytes", ()) or (0,))
    if not largest:
        return 0.0
    return estimate_collective_s("send", largest, 2, profile, dp >= profile.devices_per_node)


def _kinds_of(timeline: Any, rank: int) -> dict[str, float]:
    """Seconds ``rank`` spends in each compute kind in ``timeline``."""
    totals: dict[str, float] = {}
    for timed in timeline.ranks[rank]:
        kind = timed.action.kind.value
        totals[kind] = totals.get(kind, 0.0) + timed.end - timed.start
    return totals


def estimate_step(plans: list[Any], world: int, profile: Any, dtype: str) -> StepEstimate:
    """The estimated step of the job whose positions planned ``plans`` (see the module)."""
    base = plans[0]
    pp = len(plans)
    dp = world // pp
    inter_node = dp > profile.devices_per_node
    graph_s = {g.name: _graph_s(g, dtype, profile) for plan in plans for g in plan.graphs
               if g.kind != "joint" and g.nodes}
    p2p = 0.0
    if base.pipeline is None:
        kinds = {g.kind: graph_s[g.name] for g in base.graphs
                 if g.kind in ("forward", "backward", "inference") and g.name in graph_s}
        compute = sum(kinds.values())
        bubble = 0.0
        compute_per_position = [compute]
        kinds_per_position = [kinds]
    else:
        info = base.pipeline
        schedule = build_schedule(info.schedule, info.num_ranks, info.num_microbatches)
        costs = _stage_costs(plans, info.num_stages, dtype, profile)
        p2p = _p2p_s(info, dp, profile)
        timeline = simulate(schedule, ActionCosts(stages=costs, p2p_latency=p2p))
        compute_per_position = [timeline.makespan] * pp
        bubble = max(timeline.bubble_ratio(r) for r in range(info.num_ranks))
        kinds_per_position = [_kinds_of(timeline, r) for r in range(info.num_ranks)]
    steps, exposed_max, optimizer_max = [], 0.0, 0.0
    exposed_per_position, optimizer_per_position = [], []
    for position, plan in enumerate(plans):
        compute = compute_per_position[position]
        overlapped = _collective_s(plan, dp, profile, inter_node, once=False)
        if plan.pipeline is not None:
            overlapped *= plan.pipeline.num_microbatches  # pp_reshard: per micro-batch
        exposed = max(0.0, overlapped - compute) + _collective_s(
            plan, dp, profile, inter_node, once=True)
        row = next(m for m in plan.memory if m.rank == position * dp)
        optimizer = (row.params // 4) * ADAMW_BYTES_PER_ELEMENT / profile.memory_bytes_per_s
        steps.append(compute + exposed + optimizer)
        exposed_per_position.append(exposed)
        optimizer_per_position.append(optimizer)
        exposed_max, optimizer_max = max(exposed_max, exposed), max(optimizer_max, optimizer)
    slowest = max(range(pp), key=lambda p: steps[p])
    kinds = dict(kinds_per_position[min(slowest, len(kinds_per_position) - 1)])
    if p2p:  # each cross-rank edge of the simulation waited this long
        kinds["p2p (per transfer)"] = p2p
    kinds["collectives (exposed)"] = exposed_per_position[slowest]
    kinds["optimizer"] = optimizer_per_position[slowest]
    return StepEstimate(hardware=profile.name, dtype=dtype, step_s=steps[slowest],
                        compute_s=compute_per_position[slowest],
                        exposed_communication_s=exposed_max, optimizer_s=optimizer_max,
                        bubble=bubble, graphs=tuple(graph_s.items()),
                        kinds=tuple(kinds.items()))
