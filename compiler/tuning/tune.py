"""``zeroc.tune``: estimate every candidate layout in the fake world, measure the best few.

1. **Estimate.** Each candidate (``zeroc.tuning.tune_space``) is planned with
   ``zeroc.explain(model, inputs, world=W, ...)`` on a hardware profile (the calibrated one of
   this machine by default): the plan gives a step-time estimate and every rank's peak memory.
   The fake world needs a process without a process group, so under ``torch.distributed``
   rank 0 estimates in a fresh spawned process and broadcasts the results.
2. **Filter.** Candidates whose planned peak exceeds the device's memory are rejected (with
   the memory they would need); none left is an error naming the smallest peak found.
3. **Measure.** The best ``measure`` by estimate run for real on the process group at hand: a
   deep copy of the model is parallelized and compiled, ``steps`` AdamW steps run, and the
   median step after the first (the compile) is the time; every rank agrees on the slowest
   rank's figure. Memory-saving trades (``fused_loss``, ``partitioner="min_cut"``) cost time,
   so they win only where memory is short: the estimate ranks them, the memory filter keeps
   them when nothing else fits, and the measurement settles the rest.
4. **Cache.** The winner goes to ``<cache_dir>/tune/`` (``zeroc.sharding.tune_cache``); a later
   ``tune`` of the same model, world and device returns it without searching.

A world that is not here (``world=W``) is ranked without measuring: every candidate is
screened on one profiled step and the best are planned in full (``zeroc.tuning.tune_world``).

Progress goes to the log and, on rank 0, to a one-line progress bar on stderr.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroc.runtime.cost.hardware import get_profile
from zeroc.runtime.errors import OptionError
from zeroc.runtime.mesh import group_device
from zeroc.runtime.plan.plan_text import human_bytes
from zeroc.runtime.step_clock import RegionTimer
from zeroc.sharding.tune_cache import cache_path, read_cached, read_on_rank0, write_cached
from zeroc.tuning.tune_estimate import estimate_all
from zeroc.tuning.tune_result import Trial, TuneResult
from zeroc.tuning.tune_space import Candidate, candidates, model_key, offload_variants
from zeroc.tuning.tune_world import PLAN_BUDGET_S, tune_world

__all__ = ["TuneResult", "Trial", "tune"]

log = logging.getLogger(__name__)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _progress(rank: int, phase: str, done: int, total: int) -> None:
    if rank != 0 or total == 0:
        return
    width = 24
    filled = int(width * done / total)
    sys.stderr.write(f"\rzeroc.tune: {phase:<10} [{'#' * filled}{'.' * (width - filled)}] "
                     f"{done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _batch_rows(example_inputs: Any) -> int:
    values = example_inputs.values() if isinstance(example_inputs, dict) else (
        example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,))
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise OptionError("zeroc.tune: example_inputs hold no batched tensor; pass the model's "
                      "inputs at one replica's batch, as a tuple or a dict")


def _call(compiled: Any, example_inputs: Any) -> torch.Tensor:
    out = compiled(**example_inputs) if isinstance(example_inputs, dict) else compiled(
        *example_inputs)
    loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise OptionError(f"zeroc.tune: the model returned {type(out).__name__}; tuning "
                          "trains it, so it must return a scalar loss (or an output with .loss)")
    return loss


def _same_inputs(example_inputs: Any) -> Any:
    """Rank 0's inputs on every rank: a pipeline needs one batch per pipeline."""
    world, _ = _world()
    if world == 1:
        return example_inputs
    values = example_inputs.values() if isinstance(example_inputs, dict) else example_inputs
    device = group_device()  # an NCCL group takes tensors on the rank's GPU only
    for value in values:
        if isinstance(value, torch.Tensor):
            moved = value.to(device)
            dist.broadcast(moved, src=0)
            if moved is not value:
                value.copy_(moved)
    return example_inputs


def _trial_device(model: nn.Module) -> torch.device:
    """Where a trial's parameters live (the device whose work ``measure`` times)."""
    return next((p.device for p in model.parameters() if not p.is_meta),
                torch.device("cpu"))


MEASURE_BUDGET_S = 300.0  # default seconds for tuning the world at hand
WARMUP_STEPS = 2  # the compiling step and one more (a recompile after the first step)


def measure(model: nn.Module, example_inputs: Any, candidate: Candidate, steps: int) -> float:
    """Median seconds of ``steps`` training steps of ``candidate`` after ``WARMUP_STEPS``
    (compiling) ones, the slowest rank's; raises what the candidate raised."""
    from zeroc.sharding.parallelize import parallelize

    torch.compiler.reset()
    trial = parallelize(copy.deepcopy(model), zero=candidate.zero, pp=candidate.pp,
                        offload=candidate.offload)
    compiled = torch.compile(trial, backend="zeroc", options=candidate.options_dict())
    optimizer = torch.optim.AdamW(trial.parameters(), lr=1e-4)
    timer = RegionTimer(_trial_device(trial))  # on CUDA: the device's time (events)
    for _ in range(steps + WARMUP_STEPS):
        with timer.region():
            _call(compiled, example_inputs).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    times = timer.seconds()
    median = torch.tensor(statistics.median(times[WARMUP_STEPS:]), dtype=torch.float64,
                          device=group_device())
    if _world()[0] > 1:
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
    torch.compiler.reset()
    return float(median)


def _agree_failed(failed: bool) -> bool:
    if _world()[0] == 1:
        return failed
    flag = torch.tensor(1 if failed else 0, device=group_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def tune(model: nn.Module, example_inputs: Any, *, budget_s: float | None = None,
         search: dict[str, Any] | None = None, measure_best: int = 3, steps: int = 5,
         device: str | None = None, hardware: Any = None, cache_dir: str | None = None,
         force: bool = False, world: int | None = None, lossy: bool = False) -> TuneResult:
    """Choose a layout and options for ``model`` (not yet parallelized) on this world.

    ``example_inputs``: one replica's batch (a tuple or a dict of keyword inputs; under
    ``torch.distributed`` rank 0's is used everywhere). ``search``: axes to narrow or widen
    (``zeroc.tuning.tune_space.SEARCH_AXES``). ``budget_s``: wall-clock seconds for estimating and
    measuring (default 300; 90 for a world that is not here); ``measure_best``: how many
    candidates run for real (for a world that is not here: at most how many are planned in
    full after the screen). ``hardware``: the profile
    estimates use (default: ``zeroc.calibrate()`` of this machine). Returns a ``TuneResult``;
    ``result.apply(model)`` parallelizes and returns the compile options.

    ``world=W`` (not this process's world) ranks layouts for a W-rank job from the fake world
    alone, measuring nothing (``result.measured`` is False; ``result.why()`` says why the
    winner wins): every candidate is screened on one profiled step and the best are planned
    in full (``zeroc.tuning.tune_world``). The model may then be on the meta device.

    ``lossy=True`` allows options that change the numbers within their error bounds
    (quantized collectives) as candidates where the data-parallel link is slow; without it
    only ``search`` can ask for them.
    """
    here, rank = _world()
    planning = world is not None and world != here
    if budget_s is None:
        budget_s = PLAN_BUDGET_S if planning else MEASURE_BUDGET_S
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not (
            0 < budget_s < math.inf) or measure_best < 1 or steps < 1:
        raise OptionError(f"zeroc.tune: budget_s={budget_s!r} must be a finite number > 0, "
                          f"measure_best={measure_best!r} and steps={steps!r} >= 1")
    world = here if world is None else world
    if world < 1:
        raise OptionError(f"zeroc.tune: world={world!r} must be a positive number of ranks")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    key = model_key(model, example_inputs)
    path = cache_path(cache_dir, key, world, device)
    cached = None if force else read_on_rank0(read_cached, path, key, world, device)
    if cached is not None:
        log.info("zeroc.tune: using the cached layout %s from %s", cached["best"].label(), path)
        trials = tuple(Trial(Candidate.from_json(t["candidate"]), t["estimated_s"],
                             t["peak_bytes"], t["measured_s"], t["rejected"],
                             dict(t["parts"]), t["screened_s"])
                       for t in cached["trials"])
        return TuneResult(cached["best"], trials, True, path)
    start = time.perf_counter()
    if hardware is None:
        from zeroc.tuning.calibrate import calibrate

        hardware = calibrate(cache_dir=cache_dir)
    hardware = get_profile(hardware)  # a name or a dict: the profile (raises naming them)
    space = candidates(world, _batch_rows(example_inputs), search, hardware, lossy)
    log.info("zeroc.tune: %d candidates for world %d on %s", len(space), world, device)
    if planning:
        return tune_world(model, example_inputs, space, world=world, device=device,
                          hardware=hardware, budget_s=budget_s, plan_best=measure_best,
                          path=path, progress=lambda phase, d, t: _progress(rank, phase, d, t))

    def estimated(layouts: list[Candidate]) -> list[Trial]:
        estimates = estimate_all(model, example_inputs, layouts, world=world, device=device,
                                 hardware=hardware, budget_s=budget_s,
                                 progress=lambda d, t: _progress(rank, "estimating", d, t))
        found = []
        for candidate in layouts:
            step, peak, reason, parts = estimates.get(
                candidate, (None, None, "not estimated: budget spent", {}))
            trial = Trial(candidate, estimated_s=step, peak_bytes=peak, rejected=reason,
                          parts=parts)
            if not trial.rejected and capacity and peak and peak > capacity:
                trial.rejected = f"needs {human_bytes(peak)} > {human_bytes(capacity)}"
            found.append(trial)
        return found

    capacity = hardware.memory_bytes
    trials = estimated(space)

    def fitting() -> list[Trial]:
        # By estimate; unestimated ones (the planning process failed) after, in search order.
        return sorted((t for t in trials if not t.rejected),
                      key=lambda t: (t.estimated_s is None, t.estimated_s or 0.0))

    alive = fitting()
    offloaded = offload_variants(space)
    if not alive and offloaded and any(t.peak_bytes for t in trials):
        log.warning("zeroc.tune: no layout fits on %s without optimizer offload; estimating "
                    "%d layouts that offload it", device, len(offloaded))
        trials += estimated(offloaded)
        alive = fitting()
    if not alive:
        peaks = [t.peak_bytes for t in trials if t.peak_bytes]
        if peaks:
            raise OptionError(
                f"zeroc.tune: no candidate fits in memory on {device}: the smallest planned "
                f"peak is {human_bytes(min(peaks))} against {human_bytes(capacity or 0)}; "
                "widen the search (more pipeline stages, ZeRO-3) or use a smaller batch")
        reasons = sorted({t.rejected for t in trials})
        raise OptionError(f"zeroc.tune: no candidate could be planned ({'; '.join(reasons)})")
    spent = time.perf_counter() - start
    one = spent / max(1, sum(1 for t in trials if t.estimated_s is not None))
    if spent > budget_s:
        raise OptionError(
            f"zeroc.tune: budget_s={budget_s:g} is too small: estimating took {spent:.1f} s "
            f"(about {one:.1f} s a candidate) and measuring one takes longer; give at least "
            f"{spent + 3 * one:.0f} s or narrow the search")
    example_inputs = _same_inputs(example_inputs)
    chosen = alive[:measure_best]
    for done, trial in enumerate(chosen):
        if time.perf_counter() - start > budget_s and done:
            trial.rejected = "not measured: budget spent"
            continue
        try:
            failed, seconds = False, measure(model, example_inputs, trial.candidate, steps)
        except Exception as error:  # a candidate that cannot run loses, the rest go on
            log.warning("zeroc.tune: %s failed: %s", trial.candidate.label(), error)
            failed, seconds = True, None
            trial.rejected = f"failed: {str(error).splitlines()[0] if str(error) else ''}"
        if _agree_failed(failed):
            trial.rejected = trial.rejected or "failed on another rank"
        else:
            trial.measured_s = seconds
        _progress(rank, "measuring", done + 1, len(chosen))
    measured = [t for t in chosen if t.measured_s is not None]
    if not measured:
        raise OptionError("zeroc.tune: no candidate ran; see the warnings for why")
    best = min(measured, key=lambda t: t.measured_s).candidate
    if rank == 0:
        write_cached(cache_dir, model, example_inputs, world, device, best,
                     [t.to_json() for t in trials])
    result = TuneResult(best, tuple(trials), False, path)
    log.info("zeroc.tune: chose %s in %.1f s\n%s", best.label(),
             time.perf_counter() - start, result.table())
    return result
