"""Screen every candidate layout from one profiled step, before any is planned in full.

A plan of one layout of a 7B-shaped model at world 64 takes tens of seconds (Dynamo, the
passes, every pipeline position's fake step), and ``zeroc.tune`` has over a hundred layouts
to rank there. So, for a world that is not here, the tuner first screens them all on one
``ModelProfile`` (``zeroc.world.model_profile``: the plain model's fake training step, op by op)
and plans in full only the best few. The screen models, per candidate:

- **stages**: the forward ops cut into the schedule's stages (``pp``, or ``2 pp`` for the
  V-shaped schedules), in order, where the compiler's stage split cuts its units: the cut
  that minimises the slowest stage's forward time (``zeroc.passes.stage_balance``'s
  ``partition_costs``); each stage's parameters are those its ops read first, its saved
  bytes those its ops' outputs autograd keeps.
- **compute**: every op as a roofline on the profile (``estimate_compute_s``) at the
  micro-batch's rows, except elementwise ops, which a compiled graph fuses: each run of
  them is one kernel (one launch floor) that writes each op's output once; a stage's
  backward is its forward times the step's backward/forward ratio, split evenly into input
  and weight gradients. The recomputing partitioner (``partitioner="min_cut"``) saves no
  elementwise output; running those ops again fuses into the backward's kernels, which
  read their inputs anyway, so it adds no time here (a plan of the compiled graphs finds
  it a few percent faster, from fewer writes, or slower: the plan decides). The fused loss
  (``fused_loss=True``) saves no logits-sized tensor and recomputes the ops that made
  them, chunk by chunk, in the backward.
- **the pipeline**: the schedule run through the simulator (``zeroc.runtime.cost.simulate``) with
  these per-stage costs and the p2p time of one stage boundary's activation, which gives
  the step's makespan, its bubble, and how many micro-batches each rank holds at once.
- **ZeRO**: model state per rank (16 bytes per fp32 parameter: the parameter, its
  gradient, two AdamW moments; divided over the data-parallel ranks as ``state_bytes``
  says) and the collectives a step issues (ring model on the profile's links), exposed in
  full for a pipeline (gathered once per step) and, for ZeRO-3 without a pipeline, hidden
  behind the compute when ``prefetch`` issues the next gather early. Held on top during the
  step: at ZeRO-3 without a pipeline the parameters of the op that runs and those
  prefetched; at ZeRO-2, and in a pipeline at ZeRO-3, the rank's whole parameters, and a
  pipeline's full gradients too (summed over the micro-batches, reduced once). The
  backward's working set is two of the stage's largest outputs.
- **the optimizer**: AdamW's 28 bytes per parameter element a rank updates, at memory
  bandwidth.
- **optimizer offload**: the device keeps the parameter shard (and, in the backward, the
  gradient shard until it is copied out); the step's optimizer time is AdamW at the host's
  bandwidth plus the two copies over the link (``offload_step_s``).
- **quantized collectives** (``gather_quant``, ``reduce_quant``): the collective's time scaled
  by the bytes it moves per fp32 byte (``QUANT_WIRE``: 0.254 for int8, 0.129 for int4), plus a
  quantize and dequantize pass over the rank's parameters at memory bandwidth.
- **hpZ** (``secondary_shard=k``, ZeRO-3 at pp=1): the backward's gather runs over ``k``
  ranks on the node's link instead of the data-parallel group's; the pieces the forward
  keeps for it (``1/k`` of the parameters) are held through the step.

The screen is a model of what a plan would find, not a plan: the tuner plans the winners in
full (``zeroc.world.world_plan``) and ranks them by their plans.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeroc.passes.schedule import build_schedule
from zeroc.passes.stage_balance import partition_costs
from zeroc.runtime.cost.hardware import estimate_collective_s, estimate_compute_s
from zeroc.runtime.cost.simulate import ActionCosts, simulate
from zeroc.runtime.gather_quant import BLOCK as QUANT_BLOCK
from zeroc.tuning.tune_space import Candidate
from zeroc.world.model_profile import ModelProfile, OpRecord

__all__ = ["Screened", "screen", "state_bytes"]

ADAMW_BYTES_PER_ELEMENT = 28  # read p, g, m, v; write p, m, v: 7 fp32 values
# Quantized collectives: the bytes moved per fp32 byte (values and one fp32 scale per block)
# and the bytes a quantize + dequantize pass reads and writes per element.
QUANT_WIRE = {"int8": (1 + 4 / QUANT_BLOCK) / 4, "int4": (0.5 + 4 / QUANT_BLOCK) / 4}
QUANT_PASS_BYTES = 10
# Optimizer offload: the host's memory bandwidth one rank's AdamW gets, and the device-host
# link per direction (PCIe 4.0 x16); a step moves the gradient shard out and the updated
# parameter shard back (4 bytes each per fp32 element).
OFFLOAD_HOST_BYTES_PER_S = 20e9
OFFLOAD_LINK_BYTES_PER_S = 25e9


def offload_step_s(elements: int) -> float:
    """Seconds of an offloaded optimizer step over ``elements`` fp32 shard elements: AdamW
    on the host and the two copies over the link."""
    return (elements * ADAMW_BYTES_PER_ELEMENT / OFFLOAD_HOST_BYTES_PER_S
            + elements * 8 / OFFLOAD_LINK_BYTES_PER_S)
STATE_BYTES_PER_PARAM_BYTE = 4  # fp32 parameter, gradient and two moments: 4x the parameter
V_SHAPED = ("dualpipev",)  # schedules that place two stages on every rank


@dataclasses.dataclass(frozen=True)
class Screened:
    """A candidate's screened step (seconds), the largest rank's peak bytes and model state
    between steps (``state_bytes``), and the step's parts."""

    step_s: float
    peak_bytes: int
    state_bytes: int
    parts: dict[str, float]


@dataclasses.dataclass(frozen=True)
class _Stage:
    end: int  # the forward op after the stage's last
    forward_s: float
    loss_recompute_s: float  # what the fused loss runs again, chunk by chunk
    saved: int
    saved_pointwise: int
    saved_logits: int
    saved_logits_pointwise: int
    params: int
    largest_param_op: int
    largest_output: int


def _cut(times: list[float], stages: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges of ``times``, one per stage, that minimise the
    largest sum: the stage split's balance (``partition_costs``) on per-op times."""
    if len(times) < stages:  # fewer ops than stages: one op each, empty stages at the end
        return [(i, i + 1) for i in range(len(times))] + [(len(times), len(times))] * (
            stages - len(times))
    starts = partition_costs(times, stages)
    return list(zip(starts, [*starts[1:], len(times)], strict=True))


def _stages(profile: ModelProfile, times: list[float], count: int) -> list[_Stage]:
    logits = profile.largest_output()
    found = []
    for start, end in _cut(times, count):
        ops: list[OpRecord] = list(profile.forward[start:end])
        op_s = times[start:end]
        found.append(_Stage(
            end=end,
            forward_s=sum(op_s),
            loss_recompute_s=sum(t for t, op in zip(op_s, ops, strict=True)
                                 if logits and op.out_bytes * 2 >= logits),
            saved=sum(op.saved for op in ops),
            saved_pointwise=sum(op.saved for op in ops if op.pointwise),
            # logits-sized outputs the fused loss does not save (elementwise ones: counted
            # once, with the recomputing partitioner's)
            saved_logits=sum(op.saved for op in ops if logits and op.out_bytes * 2 >= logits
                             and not op.pointwise),
            saved_logits_pointwise=sum(op.saved for op in ops if op.pointwise and logits
                                       and op.out_bytes * 2 >= logits),
            params=sum(op.param_bytes for op in ops),
            largest_param_op=max((op.param_bytes for op in ops), default=0),
            largest_output=max((op.out_bytes for op in ops), default=0)))
    return found


def state_bytes(params: int, zero: int, dp: int) -> int:
    """Parameters, gradients and AdamW moments a rank keeps between steps for ``params``
    fp32 bytes at ZeRO ``zero``: ZeRO-1 keeps whole parameters and shards the gradients
    (the rows its reduce-scatter gives) and moments, ZeRO-2 and 3 all three (ZeRO-2 gathers
    the parameters for the whole step, ZeRO-3 where they are used)."""
    shard = -(-params // dp)
    if zero == 0:
        return STATE_BYTES_PER_PARAM_BYTE * params
    if zero == 1:
        return params + 3 * shard
    return STATE_BYTES_PER_PARAM_BYTE * shard


def _zero_collectives_s(params: int, zero: int, dp: int, piped: bool, hardware: Any,
                        inter_node: bool, secondary: int = 0) -> tuple[float, float]:
    """(gather seconds, reduction seconds) of one step's ZeRO collectives over ``params``;
    ``secondary``: hpZ's group size (the backward gathers over it, inside a node)."""
    if dp == 1:
        return 0.0, 0.0
    if zero == 0:
        return 0.0, estimate_collective_s("all_reduce", params, dp, hardware, inter_node)
    gather = estimate_collective_s("all_gather", params, dp, hardware, inter_node)
    reduce = estimate_collective_s("reduce_scatter", params, dp, hardware, inter_node)
    if zero == 3 and not piped:  # gathered again for the backward
        gather += estimate_collective_s("all_gather", params, secondary, hardware, False) \
            if secondary else gather
    return gather, reduce


def _times(ops: tuple[OpRecord, ...], scale: float, forward: bool, recompute: bool,
           dtype: str, hardware: Any) -> list[float]:
    """Each op's seconds at ``scale`` of the profiled batch (see the module's compute)."""
    found = []
    for index, op in enumerate(ops):
        if not op.pointwise:
            found.append(estimate_compute_s(op.flops * scale, op.bytes * scale, dtype,
                                            hardware))
            continue
        # One fused kernel per run of elementwise ops: one launch; it writes the run's
        # result, and in the forward what the backward keeps (nothing elementwise when the
        # partitioner recomputes it).
        first = index == 0 or not ops[index - 1].pointwise
        last = index + 1 == len(ops) or not ops[index + 1].pointwise
        written = last or (forward and op.saved and not recompute)
        seconds = op.out_bytes * scale / hardware.memory_bytes_per_s if written else 0.0
        found.append(max(seconds, hardware.launch_floor_s) if first else seconds)
    return found


# Candidates differ mostly in ZeRO stage and options that leave the compute alone: the op
# times and stage cuts of one profile are kept per (scale, recompute, stages, dtype, profile).
_COSTED: dict[tuple[Any, ...], tuple[float, list[_Stage]]] = {}
_BACKWARD: dict[tuple[Any, ...], float] = {}
_COSTED_FOR: list[Any] = [None]


def _costed(profile: ModelProfile, scale: float, recompute: bool, stage_count: int,
            dtype: str, hardware: Any) -> tuple[float, list[_Stage]]:
    """(backward/forward ratio, stages) of ``profile`` at ``scale``."""
    if _COSTED_FOR[0] is not profile:
        _COSTED.clear()
        _BACKWARD.clear()
        _COSTED_FOR[0] = profile
    key = (scale, recompute, stage_count, dtype, id(hardware))
    if key not in _COSTED:
        times = _times(profile.forward, scale, True, recompute, dtype, hardware)
        backward = _costed_backward(profile, scale, dtype, hardware)
        ratio = backward / (sum(times) or 1e-12)
        _COSTED[key] = (ratio, _stages(profile, times, stage_count))
    return _COSTED[key]


def _costed_backward(profile: ModelProfile, scale: float, dtype: str, hardware: Any) -> float:
    key = (scale, dtype, id(hardware))
    if key not in _BACKWARD:
        _BACKWARD[key] = sum(_times(profile.backward, scale, False, False, dtype, hardware))
    return _BACKWARD[key]


def screen(profile: ModelProfile, candidate: Candidate, world: int, hardware: Any,
           dtype: str = "float32") -> Screened:
    """The screened step and peak of ``candidate`` on ``hardware`` (see the module)."""
    options = candidate.options_dict()
    pp, zero = candidate.pp, candidate.zero
    dp = world // pp
    microbatches = int(options.get("microbatches") or 1) if pp > 1 else 1
    schedule_name = options.get("schedule") or "1f1b"
    stage_count = 2 * pp if pp > 1 and schedule_name in V_SHAPED else pp
    scale = 1.0 / microbatches

    recompute = options.get("partitioner", "min_cut") == "min_cut"
    ratio, stages = _costed(profile, scale, recompute, stage_count, dtype, hardware)
    fused = bool(options.get("fused_loss", True))
    costs, saved = [], []
    for stage in stages:
        backward = stage.forward_s * ratio
        backward += stage.loss_recompute_s if fused else 0.0
        costs.append((stage.forward_s, backward, backward / 2))
        kept = stage.saved - (stage.saved_pointwise if recompute else 0)
        if fused:
            kept -= stage.saved_logits + (0 if recompute else stage.saved_logits_pointwise)
        saved.append(max(0, int(kept * scale)))
    inter_node = dp > hardware.devices_per_node
    schedule = build_schedule(schedule_name, pp, microbatches) if pp > 1 else None
    if schedule is not None:
        message = int(max((profile.forward[max(0, stage.end - 1)].out_bytes
                           for stage in stages[:-1]), default=0) * scale)
        p2p = estimate_collective_s("send", message, 2, hardware,
                                    dp >= hardware.devices_per_node)
        timeline = simulate(schedule, ActionCosts(stages=tuple(costs), p2p_latency=p2p))
        compute_s, bubble = timeline.makespan, max(
            timeline.bubble_ratio(r) for r in range(pp))
        in_flight = timeline.peak_activations
    else:
        compute_s, bubble = costs[0][0] + costs[0][1], 0.0
        in_flight = (1,)
    steps, peaks, states, exposed_all, optimizer_all = [], [], [], [], []
    for rank in range(pp):
        mine = _placement(schedule, rank, stage_count)
        params = sum(stages[s].params for s in mine)
        secondary = int(options.get("secondary_shard") or 0)
        gather_s, reduce_s = _zero_collectives_s(params, zero, dp, pp > 1, hardware,
                                                 inter_node, secondary)
        quant_s = 0.0
        for key, kind in (("gather_quant", "gather"), ("reduce_quant", "reduce")):
            if options.get(key) and dp > 1:
                if kind == "gather":
                    gather_s *= QUANT_WIRE[options[key]]
                else:
                    reduce_s *= QUANT_WIRE[options[key]]
                quant_s += params // 4 * QUANT_PASS_BYTES / hardware.memory_bytes_per_s
        if pp > 1:
            exposed = gather_s + reduce_s
        elif zero == 3 and int(options.get("prefetch", 1) or 0) > 0:
            exposed = max(0.0, gather_s + reduce_s - compute_s)
        else:
            exposed = gather_s + max(0.0, reduce_s - costs[0][1])
        elements = params // 4 if zero == 0 else -(-params // 4 // dp)
        optimizer_s = elements * ADAMW_BYTES_PER_ELEMENT / hardware.memory_bytes_per_s
        if candidate.offload:
            optimizer_s = offload_step_s(elements)
        activations = max(saved[s] for s in mine) * in_flight[rank]
        if not fused and stage_count - 1 in mine:  # the logits' gradient, while it lives
            activations += int(profile.largest_output() * scale)
        # The backward's working set: an op's output gradient and its input's, at once.
        activations += 2 * int(max(stages[s].largest_output for s in mine) * scale)
        gathered = 0
        if zero == 3 and pp == 1:
            gathered = max(stages[s].largest_param_op for s in mine) * (
                1 + int(options.get("prefetch", 1) or 0))
            gathered += params // secondary if secondary else 0  # hpZ's pieces
        elif zero >= 2:  # the whole step's parameters; a pipeline's summed full gradients
            gathered = params * (2 if pp > 1 else 1)
        state = state_bytes(params, zero, dp)
        if candidate.offload:  # the device keeps the shard; its gradient while it is copied
            state = -(-params // dp)
            activations += state
        states.append(state)
        peaks.append(state + activations + gathered)
        steps.append(compute_s + exposed + optimizer_s + quant_s)
        exposed_all.append(exposed)
        optimizer_all.append(optimizer_s)
    slowest = max(range(pp), key=lambda r: steps[r])
    return Screened(step_s=steps[slowest], peak_bytes=max(peaks), state_bytes=max(states),
                    parts={
        "compute_s": compute_s, "exposed_communication_s": max(exposed_all),
        "optimizer_s": max(optimizer_all), "bubble": bubble})


def _placement(schedule: Any, rank: int, stage_count: int) -> list[int]:
    """The stages ``rank`` runs in ``schedule`` (every stage without a pipeline)."""
    if schedule is None:
        return list(range(stage_count))
    return sorted({a.stage for a in schedule.compute_actions(rank) if a.stage is not None})
