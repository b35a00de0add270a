"""The step time of a planned job, estimated from a hardware profile.

``estimate_step(plans, world, profile, dtype)`` takes the plan of every pipeline position
(``zeroc.world.world_plan``) and models one training step on ``profile``
(``zeroc.runtime.cost.hardware``):

- compute: every compiled graph as a roofline, ``max(FLOPs / peak(dtype), bytes / memory
  bandwidth)``, at least the launch floor. When the plan is for this machine's CPU
  (``op_times``, ``zeroc.runtime.cost.op_timing``), each node that can be rebuilt is instead
  timed on it, views (each is a dispatcher call) and zeroc's fused kernels included, with
  its output written to fresh memory as in a training graph, times how much slower the host's
  ranks compute together than alone (``zeroc.runtime.cost.shared_cores``); the roofline stays for
  the rest. Pipelines: each stage's F, B and W from its own
  graphs (``g0.s3.forward``, ``.backward`` or ``.input_grad`` + ``.weight_grad``), run
  through the schedule simulator (``zeroc.runtime.cost.simulate``), so the bubble is the one of this
  schedule with these costs; one rank's step is the simulated makespan.
- communication: each collective from its bytes, its group size and a ring model (latency +
  bytes / link bandwidth; inter-node links when the data-parallel group spans more devices
  than a node has). A collective inside a graph runs on one communication stream from the
  node that issues it, and the node that waits for it waits for its end: it hides behind the
  compute between issue and wait, and the rest is exposed (a graph's time includes it; in a
  pipeline, so do the stage costs). On this machine's CPU, when the ranks' threads fill its
  cores, gloo's copies and reductions run on the cores that compute: each collective runs in
  line, and nothing hides. The once-per-step ZeRO gathers and reductions of a
  pipeline (``g0.step``) and the optimizer step's are exposed in full. A pipeline's p2p
  transfer (the largest message between two stages, ``PipelineInfo.message_bytes``: latency +
  bytes / link bandwidth, inter-node links when a pipeline position spans a node) delays
  every dependency that crosses ranks in the simulation.
- the optimizer: AdamW reads and writes 28 bytes per fp32 element a rank holds (parameter,
  gradient, two moments), at memory bandwidth; on a CPU profile also 12 ops per parameter
  tensor at the launch floor (torch's CPU default is its per-tensor loop). With ``op_times``
  an AdamW step over tensors of the rank's sizes is timed instead, on DTensors at ZeRO >= 1
  (each op's DTensor dispatch is most of a small model's step).

A rank's step is the sum; the job's step is its slowest position's. The estimate also gives
every graph's time per call (``StepEstimate.graphs``) and the slowest rank's step by action
kind (``StepEstimate.kinds``: the pipeline's F, B, I, W and F&B actions, or the forward and
backward graphs, then p2p, exposed collectives and the optimizer).
"""

from __future__ import annotations

from typing import Any

from zeroc.passes.program.schedule import build_schedule
from zeroc.runtime.cost.hardware import estimate_collective_s, estimate_compute_s
from zeroc.runtime.cost.simulate import ActionCosts, simulate
from zeroc.runtime.plan.records import StepEstimate

__all__ = ["estimate_step"]

ADAMW_BYTES_PER_ELEMENT = 28  # read p, g, m, v and write p, m, v: 7 fp32 values
# Ops torch's single-tensor AdamW (its default on the CPU) runs per parameter tensor: each
# pays the launch floor (on a GPU the default foreach path runs them once per group).
ADAMW_OPS_PER_TENSOR = 12


def _optimizer_s(plan: Any, position: int, params_bytes: int, profile: Any,
                 op_times: Any = None) -> float:
    """AdamW on what a rank holds: timed on this machine (``op_times``: an AdamW step over
    tensors of the rank's parameters' sizes, DTensors at ZeRO >= 1), else its elements at
    memory bandwidth plus, on a CPU, the launch floor of every op the per-tensor loop runs."""
    if plan.pipeline is None:
        names = None
        tensors = len(plan.params)
    else:
        names = {n for s, ranks in enumerate(plan.pipeline.placement) if position in ranks
                 for n in plan.stages[s].param_names}
        tensors = len(names)
    if op_times is not None:
        dp = max(1, plan.meta.world_size // (plan.pipeline.num_ranks if plan.pipeline else 1))
        # The optimizer updates this rank's rows: a shard of each parameter at ZeRO >= 1.
        numels = [-(-max(p.numel, 1) // dp) if plan.meta.zero == 1 else p.numel
                  for p in plan.params if names is None or p.name in names]
        measured = op_times.optimizer_seconds(numels, plan.meta.zero >= 1)
        if measured is not None:
            return measured
    seconds = (params_bytes // 4) * ADAMW_BYTES_PER_ELEMENT / profile.memory_bytes_per_s
    if not profile.name.startswith("cpu"):
        return seconds
    return seconds + tensors * ADAMW_OPS_PER_TENSOR * profile.launch_floor_s


def _node_s(node: Any, dtype: str, profile: Any, op_times: Any) -> float:
    """One node's seconds: measured on this machine when ``op_times`` can time its call, else
    the roofline of a node that does work (FLOPs or bytes), else nothing."""
    if op_times is not None:
        measured = op_times.seconds(getattr(node, "call", ""))
        if measured is not None:
            return measured
    if node.flops or node.bytes:
        return estimate_compute_s(node.flops, node.bytes, dtype, profile)
    return 0.0


def _graph_s(graph: Any, dtype: str, profile: Any) -> float:
    """A graph's compute time: the roofline of every node that does work (FLOPs or bytes),
    each at least the profile's launch floor (on a CPU or for small ops the floor is most of
    the time); a graph without node costs as one roofline."""
    working = [c for c in getattr(graph, "node_costs", ()) if c.flops or c.bytes]
    if not working:
        return estimate_compute_s(graph.flops, graph.bytes, dtype, profile)
    return sum(estimate_compute_s(c.flops, c.bytes, dtype, profile) for c in working)


def _one_collective_s(c: Any, dp: int, profile: Any, inter_node: bool) -> float:
    kind = c.op if c.op in ("all_gather", "reduce_scatter") else "all_reduce"
    # zeroc's byte accounting: a gather / reduce-scatter of X moves X, an all-reduce 2X.
    nbytes = c.bytes if kind != "all_reduce" else c.bytes // 2
    return estimate_collective_s(kind, nbytes, dp, profile, inter_node)


def _graph_timeline_s(graph: Any, collectives: list[Any], dtype: str, profile: Any, dp: int,
                      inter_node: bool, op_times: Any = None) -> tuple[float, float]:
    """``(compute, total)`` seconds of one call of ``graph`` with its collectives: the nodes
    run in graph order on the compute stream; a collective starts on the one communication
    stream when its issuing node has run (and the previous collective is done) and the node
    that waits for it starts no earlier than its end. So a gather issued early and waited
    late hides behind the compute between, and what it does not hide is exposed. A
    collective whose issue or wait node is not among the graph's nodes is issued at the start
    and waited at the end."""
    nodes = list(getattr(graph, "node_costs", ()))
    names = {c.name for c in nodes}
    issued: dict[str, list[Any]] = {}
    waited: dict[str, list[Any]] = {}
    loose = []
    for c in collectives:
        if c.issued_at in names and c.waited_at in names:
            issued.setdefault(c.issued_at, []).append(c)
            waited.setdefault(c.waited_at, []).append(c)
        else:
            loose.append(c)
    # On CPU ranks that fill their host's cores the collectives run on the cores that compute
    # (``zeroc.runtime.cost.shared_cores``): each runs in line, nothing hides.
    inline = bool(getattr(op_times, "inline_communication", False))
    now = comm_free = compute = 0.0
    ends: dict[str, float] = {}
    for c in loose:
        comm_free += _one_collective_s(c, dp, profile, inter_node)
    if inline:
        now = comm_free
    for node in nodes:
        for c in waited.get(node.name, ()):
            now = max(now, ends.get(c.name, now))
        seconds = _node_s(node, dtype, profile, op_times)
        now += seconds
        compute += seconds
        for c in issued.get(node.name, ()):
            start = max(now, comm_free)
            comm_free = ends[c.name] = start + _one_collective_s(c, dp, profile, inter_node)
            if inline:
                now = comm_free
    if not nodes:
        compute = now = _graph_s(graph, dtype, profile)
    return compute, max(now, comm_free)


def _stage_costs(graph_s: dict[str, float],
                 num_stages: int) -> tuple[tuple[float, float, float], ...]:
    """(F, B, W) seconds per stage, from the stage graphs (``g0.s3.forward``, of whichever
    position holds the stage) in ``graph_s``."""
    graphs = {name.split(".", 1)[1]: seconds for name, seconds in graph_s.items()
              if name.count(".") >= 2}
    costs = []
    for stage in range(num_stages):
        def seconds(kind: str, stage: int = stage) -> float:
            return graphs.get(f"s{stage}.{kind}", 0.0)

        forward = seconds("forward")
        weight = seconds("weight_grad")
        backward = seconds("backward") or (seconds("input_grad") + weight) or 2 * forward
        costs.append((forward, backward, min(weight, backward) if weight else backward / 2))
    return tuple(costs)


def _at_step(c: Any) -> bool:
    """Whether a collective runs once per step outside the graphs (a pipeline's ZeRO buckets,
    the optimizer step's)."""
    return c.graph.endswith(".step") or c.graph == "optimizer.step"


def _step_collectives_s(plan: Any, dp: int, profile: Any, inter_node: bool) -> float:
    return sum(_one_collective_s(c, dp, profile, inter_node) for c in plan.collectives
               if _at_step(c))


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


def estimate_step(plans: list[Any], world: int, profile: Any, dtype: str,
                  op_times: Any = None) -> StepEstimate:
    """The estimated step of the job whose positions planned ``plans`` (see the module);
    ``op_times``: an ``OpTimes`` of this machine, to time the graphs' ops on it."""
    base = plans[0]
    pp = len(plans)
    dp = world // pp
    inter_node = dp > profile.devices_per_node
    timelines = {}
    for plan in plans:
        by_graph: dict[str, list[Any]] = {}
        for c in plan.collectives:
            by_graph.setdefault(c.graph, []).append(c)
        for g in plan.graphs:
            if g.kind != "joint" and g.nodes:
                timelines[g.name] = _graph_timeline_s(g, by_graph.get(g.name, []), dtype,
                                                      profile, dp, inter_node, op_times)

    graph_s = {name: total for name, (_, total) in timelines.items()}
    p2p = 0.0
    in_graphs = 0.0  # communication the graphs' own compute does not hide
    if base.pipeline is None:
        kinds: dict[str, float] = {}  # summed per kind: a graph break makes several graphs
        for g in base.graphs:
            if g.kind in ("forward", "backward", "inference") and g.name in graph_s:
                kinds[g.kind] = kinds.get(g.kind, 0.0) + graph_s[g.name]
        in_graphs = sum(total - compute for name, (compute, total) in timelines.items()
                        if any(g.name == name and g.kind in kinds for g in base.graphs))
        bubble = 0.0
        compute_per_position = [sum(kinds.values()) - in_graphs]
        kinds_per_position = [kinds]
    else:
        info = base.pipeline
        schedule = build_schedule(info.schedule, info.num_ranks, info.num_microbatches)
        costs = _stage_costs(graph_s, info.num_stages)
        p2p = _p2p_s(info, dp, profile)
        timeline = simulate(schedule, ActionCosts(stages=costs, p2p_latency=p2p))
        compute_per_position = [timeline.makespan] * pp
        bubble = max(timeline.bubble_ratio(r) for r in range(info.num_ranks))
        kinds_per_position = [_kinds_of(timeline, r) for r in range(info.num_ranks)]
    steps: list[float] = []
    exposed_per_position: list[float] = []
    optimizer_per_position: list[float] = []
    for position, plan in enumerate(plans):
        compute = compute_per_position[position]
        exposed = in_graphs + _step_collectives_s(plan, dp, profile, inter_node)
        row = next(m for m in plan.memory if m.rank == position * dp)
        optimizer = _optimizer_s(plan, position, row.params, profile, op_times)
        steps.append(compute + exposed + optimizer)
        exposed_per_position.append(exposed)
        optimizer_per_position.append(optimizer)
    if op_times is not None:
        op_times.save()
    slowest = max(range(pp), key=lambda p: steps[p])
    kinds = dict(kinds_per_position[min(slowest, len(kinds_per_position) - 1)])
    if p2p:  # each cross-rank edge of the simulation waited this long
        kinds["p2p (per transfer)"] = p2p
    kinds["collectives (exposed)"] = exposed_per_position[slowest]
    kinds["optimizer"] = optimizer_per_position[slowest]
    return StepEstimate(hardware=profile.name, dtype=dtype, step_s=steps[slowest],
                        compute_s=compute_per_position[slowest],
                        exposed_communication_s=max(exposed_per_position),
                        optimizer_s=max(optimizer_per_position),
                        bubble=bubble, graphs=tuple(graph_s.items()),
                        kinds=tuple(kinds.items()))
