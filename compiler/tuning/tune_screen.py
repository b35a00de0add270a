"""Screen every candidate layout from one profiled step, before any is planned in full.

A plan of one layout of a 7B-shaped model at world 64 takes tens of seconds (Dynamo, the
passes, every pipeline position's fake step), and ``zeroc.tune`` has over a hundred layouts
to rank there. So, for a world that is not here, the tuner first screens them all on one
``ModelProfile`` (``zeroc.world.model_profile``: the plain model's fake training step, op by op)
and plans in full only the best few. The screen models, per candidate:

- **stages**: the forward ops cut into the schedule's stages (``pp``, or ``2 pp`` for the
  V-shaped schedules), in order, where the compiler's stage split cuts: in front of the
  model's repeated blocks (``ModelProfile.block_starts``), balanced on the same unit cost
  with the same ``partition_costs`` (``zeroc.passes.front.stage_balance``); a model without
  blocks between any ops, on their times. Each stage's parameters are those its ops read
  first, its saved bytes those its ops' outputs autograd keeps.
- **compute**: every op as a roofline on the profile (``estimate_compute_s``) at the
  micro-batch's rows, except elementwise ops, which a compiled graph fuses: each run of
  them is one kernel (one launch floor) that writes each op's output once; a stage's
  backward is its forward times the step's backward/forward ratio, split evenly into input
  and weight gradients. The recomputing partitioner (``partitioner="min_cut"``) saves only
  the elementwise outputs that cost fewer bytes to save than what recomputing them would
  need saved instead (``OpRecord.recompute_saved``); running the others again fuses into
  the backward's kernels, which read their inputs anyway, so it adds no time here (a plan of
  the compiled graphs finds it a few percent faster, from fewer writes, or slower: the plan
  decides); where the parameters are gathered in the graph (ZeRO-2/3 at pp=1) elementwise ops
  that read one are not recomputed. The fused loss (``fused_loss=True``) saves no
  logits-sized tensor of the loss head (``ModelProfile.head``: from the output projection
  on; a long sequence's attention scores may be larger than the logits, and are saved) and
  recomputes the head's ops that made them, chunk by chunk, in the backward; a model that
  returns its logits beside the loss keeps them without a pipeline (nothing is fused).
- **the pipeline**: the schedule run through the simulator (``zeroc.runtime.cost.simulate``) with
  these per-stage costs and the p2p time of one stage boundary's activation, which gives
  the step's makespan and its bubble; each rank's actions give the most saved bytes it
  holds at once (``peak_held``: every micro-batch in flight holds its own stage's).
- **ZeRO**: model state per rank (16 bytes per fp32 parameter: the parameter, its
  gradient, two AdamW moments; divided over the data-parallel ranks as ``state_bytes``
  says) and the collectives a step issues (ring model on the profile's links), exposed in
  full for a pipeline (gathered once per step) and, for ZeRO-3 without a pipeline, hidden
  behind the compute when ``prefetch`` issues the next gather early. Held on top during the
  step: at ZeRO-3 without a pipeline the parameters of the op that runs and those
  prefetched; at ZeRO-2, and in a pipeline at ZeRO-3, the rank's whole parameters, and a
  pipeline's full gradients too (summed over the micro-batches, reduced once). The
  backward's working set is the profiled one (``ModelProfile.backward_working``: gradients
  and temporaries alive at once; the loss head's apart, which the fused loss never makes),
  and in a pipeline the full gradients a stage's backward hands to the step's sums.
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
import itertools
from typing import Any

from zeroc.passes.front.stage_balance import FLOPS_PER_BYTE, partition_costs
from zeroc.passes.program.schedule import build_schedule
from zeroc.runtime.cost.hardware import estimate_collective_s, estimate_compute_s
from zeroc.runtime.cost.simulate import ActionCosts, peak_held, simulate
from zeroc.runtime.quant.gather import BLOCK as QUANT_BLOCK
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
    saved_recompute: int  # what a recomputing partitioner saves
    saved_sharded: int  # the same where parameters are gathered in the graph
    saved_logits: int  # of ``saved``, the logits-sized outputs of the loss head
    saved_logits_recompute: int  # of ``saved_recompute``, the same
    saved_logits_sharded: int  # of ``saved_sharded``, the same
    params: int
    largest_param_op: int


def _cut(profile: ModelProfile, times: list[float], stages: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges of the forward ops, one per stage, cut as the stage
    split cuts: only in front of a block (``profile.block_starts``; what comes before the
    first block goes with it), minimising the costliest stage (``partition_costs`` on the
    stage balance's unit cost, FLOPs plus ``FLOPS_PER_BYTE`` per byte). Fewer blocks than
    stages raise ``ValueError``, as the compiler does. A model without repeated blocks is cut
    between any two ops, on their times."""
    ops, count = profile.forward, len(times)
    if profile.block_starts:
        blocks = len(profile.block_starts)
        if blocks < stages:
            raise ValueError(f"the model has {blocks} blocks for {stages} pipeline stages; "
                             "every stage needs at least one")
        bounds = [0, *profile.block_starts[1:], count]
        costs = [sum(op.flops + FLOPS_PER_BYTE * op.bytes for op in ops[a:b])
                 for a, b in itertools.pairwise(bounds)]
        starts = [bounds[i] for i in partition_costs(costs, stages)]
    elif count < stages:  # fewer ops than stages: one op each, empty stages at the end
        return [(i, i + 1) for i in range(count)] + [(count, count)] * (stages - count)
    else:
        starts = partition_costs(times, stages)
    return list(zip(starts, [*starts[1:], count], strict=True))


def _stages(profile: ModelProfile, times: list[float], count: int) -> list[_Stage]:
    logits = profile.logits_bytes()
    found = []
    for start, end in _cut(profile, times, count):
        ops: list[OpRecord] = list(profile.forward[start:end])
        op_s = times[start:end]
        # The loss head's logits-sized outputs: what the fused loss neither saves nor keeps.
        head = [start + i >= profile.head and logits > 0 and op.out_bytes * 2 >= logits
                for i, op in enumerate(ops)]
        found.append(_Stage(
            end=end,
            forward_s=sum(op_s),
            loss_recompute_s=sum(t for t, h in zip(op_s, head, strict=True) if h),
            saved=sum(op.saved for op in ops),
            saved_recompute=sum(op.recompute_saved for op in ops),
            saved_sharded=sum(op.recompute_saved_sharded for op in ops),
            saved_logits=sum(op.saved for op, h in zip(ops, head, strict=True) if h),
            saved_logits_recompute=sum(op.recompute_saved
                                       for op, h in zip(ops, head, strict=True) if h),
            saved_logits_sharded=sum(op.recompute_saved_sharded
                                     for op, h in zip(ops, head, strict=True) if h),
            params=sum(op.param_bytes for op in ops),
            largest_param_op=max((op.param_bytes for op in ops), default=0)))
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
        # result, and in the forward what the backward keeps (less when the partitioner
        # recomputes elementwise ops).
        first = index == 0 or not ops[index - 1].pointwise
        last = index + 1 == len(ops) or not ops[index + 1].pointwise
        written = last or (forward and (op.recompute_saved if recompute else op.saved))
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
    # A graph that outputs the logits keeps them: only a pipeline drops the other outputs.
    fused = bool(options.get("fused_loss", True)) and (pp > 1 or not profile.logits_returned)
    sharded = zero >= 2 and pp == 1  # the parameters are gathered inside the graph
    costs, saved = [], []
    for stage in stages:
        backward = stage.forward_s * ratio
        backward += stage.loss_recompute_s if fused else 0.0
        costs.append((stage.forward_s, backward, backward / 2))
        kept, logits = ((stage.saved, stage.saved_logits) if not recompute else
                        (stage.saved_sharded, stage.saved_logits_sharded) if sharded else
                        (stage.saved_recompute, stage.saved_logits_recompute))
        saved.append(max(0, int((kept - (logits if fused else 0)) * scale)))
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
    else:
        compute_s, bubble = costs[0][0] + costs[0][1], 0.0
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
        # What the micro-batches in flight hold at once, each its own stage's.
        activations = saved[0] if schedule is None else peak_held(
            schedule.compute_actions(rank), saved.__getitem__)
        # The backward's working set, as profiled: the loss head's (the logits' gradient)
        # where the last stage runs without the fused loss, which never makes it.
        working = profile.backward_working
        if not fused and stage_count - 1 in mine:
            working = max(working, profile.head_working)
        activations += int(working * scale)
        if pp > 1:  # the full gradients a stage's backward hands to the step's sums
            activations += max(stages[s].params for s in mine)
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
