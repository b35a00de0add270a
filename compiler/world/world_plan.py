"""``zeroc.explain(model, example_inputs, world=W, ...)``: the plan of a job that is not there.

Each pipeline position is planned once on fake tensors (``zeroc.world.fake_world.plan_position``, on
its first data-parallel rank), after what they share is built once
(``zeroc.world.fake_world.share_front``: Dynamo's trace and the pipeline front), half of them in a
helper process on a second core (``zeroc.world.plan_workers``); the positions' plans are merged into
one: the graphs, collectives, kernels and passes of position 0 (every position runs the same
passes), every position's stages (the pipeline section already holds all stages), and one
memory row per rank, measured on that rank's position. ``meta.world_size`` and ``meta.mesh``
describe the planned world, and the step time is estimated from a hardware profile
(``zeroc.runtime.cost.hardware``) when one is given.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import nn

from zeroc.passes.base import count_nodes
from zeroc.pipeline import stage_reuse
from zeroc.pipeline.pipeline_front import shared_front
from zeroc.runtime import nccl_order
from zeroc.runtime.plan.plan import Plan
from zeroc.runtime.plan.records import MemoryEstimate
from zeroc.runtime.torch_compat import preload_inductor_pattern_matcher
from zeroc.runtime.world import SharedPlanning
from zeroc.runtime.zero_ops import ZERO_STAGES
from zeroc.world.fake_world import DEVICES, plan_position, share_front
from zeroc.world.plan_capture import SharedTrace
from zeroc.world.plan_workers import (
    COMPILE_PER_NODE,
    STEP_PER_MICROBATCH,
    PositionWork,
    full_collections_deferred,
    plan_positions,
    planning_cores,
)

__all__ = ["plan_world"]

log = logging.getLogger(__name__)


def _check(world: Any, pp: Any, zero: Any, device: Any, hardware: Any) -> None:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world={world!r} is not allowed: world must be an integer >= 1")
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1 or world % pp:
        allowed = [d for d in range(1, world + 1) if world % d == 0]
        shown = allowed if len(allowed) <= 16 else [*allowed[:8], "...", *allowed[-4:]]
        raise ValueError(f"pp={pp!r} is not allowed with world={world}: pp must divide the "
                         f"world (allowed: {shown})")
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ValueError(f"zero={zero!r} is not allowed: zero must be one of 0, 1, 2, 3")
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is not allowed: use one of {list(DEVICES)}")
    if hardware is not None:
        from zeroc.runtime.cost.hardware import get_profile

        get_profile(hardware)  # raises naming the known profiles


def _position_work(pp: int, shared: SharedPlanning | None) -> dict[int, PositionWork] | None:
    """Each position's planning work, estimated from the shared front's stages (their node
    counts; stages of one structure are one program), or None without a shared front."""
    front = shared_front(shared) if shared is not None else None
    if front is None:
        return None
    placement = front.schedule.placement
    sizes = [count_nodes(spec.gm) for spec in front.split.stages]
    programs: dict[tuple, int] = {}  # a stage's structure -> a small id of its program
    ids = [programs.setdefault(stage_reuse.structure(front.split, s), len(programs))
           for s in range(len(sizes))]
    per_step = 1 + STEP_PER_MICROBATCH * front.schedule.num_microbatches
    work = {}
    for position in range(pp):
        stages = [s for s, ranks in enumerate(placement) if position in ranks]
        work[position] = PositionWork(
            programs=tuple((ids[s], COMPILE_PER_NODE * sizes[s]) for s in stages),
            step=sum(per_step * sizes[s] / len(placement[s]) for s in stages))
    return work


def _import_before_fork(options: dict | None) -> None:
    """Import what every process's first stage compile imports, once, before the positions
    are planned in two processes: the min-cut partitioner's common-subexpression pass loads
    Inductor's pattern matcher (about 2 s), which each forked process would otherwise import
    again, both at once."""
    if planning_cores() >= 2 and (options or {}).get("partitioner", "min_cut") == "min_cut":
        preload_inductor_pattern_matcher()


def plan_world(model: nn.Module, example_inputs: Any, *, world: int, pp: int = 1,
               zero: int = 3, device: str = "cuda", hardware: Any = None,
               options: dict | None = None, mixed_precision: Any = None,
               offload: str | None = None) -> Plan:
    """The plan of a ``world``-rank job (``pp`` pipeline positions of ``world // pp``
    data-parallel ranks) for ``model`` on ``example_inputs`` (a tuple of positional inputs or
    a dict of keyword inputs, at the global batch of one data-parallel replica), computed on
    this machine without the cluster. ``options``: zeroc's compile options; ``offload``:
    ``parallelize``'s (the memory rows then count the device, and the host apart)."""
    _check(world, pp, zero, device, hardware)
    dp = world // pp
    # What the positions share, this world's own (a later world gets a new one): Dynamo's
    # trace of the model, and what they would all compute alike (fronts, stages, the check
    # that the model is meta-initializable).
    shared = SharedPlanning()
    trace = SharedTrace(shared)

    def plan_one(position: int):
        log.info("planning pipeline position %d of %d (rank %d)", position + 1, pp,
                 position * dp)
        return plan_position(
            model, example_inputs, rank=position * dp, world=world, pp=pp, zero=zero,
            device=device, options=options, mixed_precision=mixed_precision, trace=trace,
            shared=shared, offload=offload)

    # What the positions share first; then the positions, on two cores where there are.
    with full_collections_deferred():
        if pp > 1 and trace is not None:
            share_front(model, example_inputs, world=world, pp=pp, zero=zero,
                        device=device, options=options, mixed_precision=mixed_precision,
                        trace=trace, shared=shared)
            _import_before_fork(options)
        positions = plan_positions(plan_one, list(range(pp)), _position_work(pp, shared))
    # The representatives are one pipeline (data-parallel index 0): their transfers must
    # match under NCCL's ordering rules, whatever the backend planned on.
    nccl_order.check({p.rank: p.p2p for p in positions if p.p2p is not None},
                     f"the planned {world}-rank job (pp={pp})")
    base = positions[0].plan
    memory = []
    for position, planned in enumerate(positions):
        row = planned.memory
        activations = max(0, row["peak"] - row["params"] - row["optimizer"])
        moved = next((m.moved for m in planned.plan.memory if m.rank == planned.rank), 0)
        for rank in range(position * dp, (position + 1) * dp):
            memory.append(MemoryEstimate(
                rank=rank, params=row["params"], grads=row["grads"], optimizer=row["optimizer"],
                activations=activations, peak=row["peak"], moved=moved,
                host=row.get("host", 0)))
    mesh = (("pp", pp), ("dp", dp))
    meta = dataclasses.replace(base.meta, world_size=world, mesh=mesh,
                               device=device if device == "cpu" else "cuda (planned)")
    plan = dataclasses.replace(base, meta=meta, memory=tuple(memory))
    if hardware is not None:
        from zeroc.runtime.cost.hardware import get_profile
        from zeroc.runtime.cost.op_timing import op_times_for
        from zeroc.world.step_estimate import estimate_step

        bf16 = mixed_precision == "bf16" or str(
            getattr(mixed_precision, "param_dtype", "")) == "torch.bfloat16"
        merged = [dataclasses.replace(p.plan, memory=tuple(
            m for m in memory if m.rank // dp == i)) for i, p in enumerate(positions)]
        profile = get_profile(hardware)
        op_times = op_times_for(profile, device, world, (options or {}).get("cache_dir"))
        plan = dataclasses.replace(plan, estimate=estimate_step(
            merged, world, profile, "bfloat16" if bf16 else "float32", op_times))
    log.info("planned a %d-rank job (%d positions, %.1f s of planning)", world, pp,
             sum(p.seconds for p in positions))
    return plan
