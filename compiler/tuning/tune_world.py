"""``zeroc.tune(..., world=W)`` for a world that is not here: screen all, plan the best.

Planning one layout of a large model for a large world takes tens of seconds (a 7B-shaped
Llama at world 64, pp 8: about a minute on a 2-core CPU), and the search holds over a hundred
layouts. So:

1. **Profile** the plain model's training step once on fake tensors of the planned device
   (``zeroc.world.model_profile``, seconds).
2. **Screen** every candidate on it (``zeroc.tuning.tune_screen``): a step time, the bubble, the
   exposed communication and the largest rank's peak memory. A candidate whose screened
   peak exceeds the device's memory is rejected; one the schedule cannot run is too.
3. **Plan** the rest in the screen's order with ``zeroc.explain(world=W, ...)`` on the
   profile (the real program on fake tensors and a fake process group: measured memory,
   the step estimated from every graph and the schedule), while the budget allows: a plan
   starts only if the last one's time still fits. At most ``plan_best`` are planned, and
   planning goes on past the budget until one planned candidate fits in memory or
   ``plan_best`` have been planned.
4. The winner is the planned candidate with the best planned step that fits.
5. If none fits, the layouts that can offload the optimizer (ZeRO-2/3 at pp=1) go through 1-4
   again offloading it: a model too large for the device gets a layout with offload.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from torch import nn

from zeroc.runtime.errors import OptionError
from zeroc.runtime.plan.plan_text import human_bytes
from zeroc.tuning.tune_estimate import estimate_all
from zeroc.tuning.tune_result import Trial, TuneResult
from zeroc.tuning.tune_screen import screen
from zeroc.tuning.tune_space import Candidate, offload_variants
from zeroc.world.model_profile import profile_model

__all__ = ["PLAN_BUDGET_S", "tune_world"]

log = logging.getLogger(__name__)

PLAN_BUDGET_S = 90.0  # default seconds for ranking a world that is not here


def _screen_all(model: nn.Module, example_inputs: Any, space: list[Candidate], world: int,
                device: str, hardware: Any) -> list[Trial]:
    try:
        profile = profile_model(model, example_inputs, device)
    except Exception as error:
        raise OptionError(f"zeroc.tune: cannot profile the model's training step on fake "
                          f"tensors: {type(error).__name__}: {error}") from error
    log.info("zeroc.tune: profiled %d forward ops, %.3g GFLOP forward, %s of parameters",
             len(profile.forward), sum(op.flops for op in profile.forward) / 1e9,
             human_bytes(profile.param_bytes))
    trials = []
    for candidate in space:
        try:
            found = screen(profile, candidate, world, hardware)
        except ValueError as error:  # a schedule that cannot run these sizes
            reason = str(error) or type(error).__name__
            trials.append(Trial(candidate, rejected=f"cannot screen: {reason}"))
            continue
        trial = Trial(candidate, peak_bytes=found.peak_bytes, parts=found.parts,
                      screened_s=found.step_s)
        capacity = hardware.memory_bytes
        if capacity and found.peak_bytes > capacity:
            trial.rejected = (f"needs {human_bytes(found.peak_bytes)} > "
                              f"{human_bytes(capacity)} (screened)")
        trials.append(trial)
    return trials


class NothingFits(OptionError):
    """No candidate fits the device; ``trials`` are what was screened and planned."""

    def __init__(self, message: str, trials: list[Trial]) -> None:
        super().__init__(message)
        self.trials = trials


def tune_world(model: nn.Module, example_inputs: Any, space: list[Candidate], *, world: int,
               device: str, hardware: Any, budget_s: float, plan_best: int, path: str,
               progress: Callable[[str, int, int], None]) -> TuneResult:
    """Rank ``space`` for a ``world``-rank job on ``hardware`` without the cluster (see the
    module docstring). When no candidate fits the device, the layouts that can offload the
    optimizer are ranked again offloading it (``offload_variants``); only if none of those
    fits either does it raise ``NothingFits``, naming the smallest peak without offload and
    the smallest with it."""
    try:
        return _rank(model, example_inputs, space, world=world, device=device,
                     hardware=hardware, budget_s=budget_s, plan_best=plan_best, path=path,
                     progress=progress)
    except NothingFits as error:
        offloaded = offload_variants(space)
        if not offloaded:
            raise
        log.warning("zeroc.tune: no layout fits on %s without optimizer offload (%s); "
                    "ranking %d layouts that offload it", device, error, len(offloaded))
        try:
            result = _rank(model, example_inputs, offloaded, world=world, device=device,
                           hardware=hardware, budget_s=budget_s, plan_best=plan_best,
                           path=path, progress=progress)
        except NothingFits as again:  # the layouts without offload said how close they came
            peaks = [t.peak_bytes for t in again.trials if t.peak_bytes]
            tail = (f"; offloading the optimizer, the smallest peak is "
                    f"{human_bytes(min(peaks))}" if peaks else "")
            raise NothingFits(f"{error}{tail}", [*error.trials, *again.trials]) from None
        return dataclasses.replace(result, trials=(*error.trials, *result.trials))


def _rank(model: nn.Module, example_inputs: Any, space: list[Candidate], *, world: int,
          device: str, hardware: Any, budget_s: float, plan_best: int, path: str,
          progress: Callable[[str, int, int], None]) -> TuneResult:
    start = time.perf_counter()
    trials = _screen_all(model, example_inputs, space, world, device, hardware)
    progress("screening", len(space), len(space))
    alive = sorted((t for t in trials if not t.rejected), key=lambda t: t.screened_s)
    if not alive:
        peaks = [t.peak_bytes for t in trials if t.peak_bytes]
        if peaks:
            raise NothingFits(
                f"zeroc.tune: no candidate fits in memory on {device}: the smallest screened "
                f"peak is {human_bytes(min(peaks))} against "
                f"{human_bytes(hardware.memory_bytes or 0)}; widen the search (more pipeline "
                "stages, ZeRO-3) or use a smaller batch", trials)
        reasons = sorted({t.rejected for t in trials})
        raise OptionError(f"zeroc.tune: no candidate could be screened ({'; '.join(reasons)})")
    log.info("zeroc.tune: screened %d candidates in %.1f s; planning the best", len(space),
             time.perf_counter() - start)
    capacity = hardware.memory_bytes
    planned: list[Trial] = []
    last_s = 0.0
    for trial in alive:
        elapsed = time.perf_counter() - start
        fitting = [t for t in planned if not t.rejected and t.estimated_s is not None]
        over = elapsed + last_s > budget_s
        if (fitting and (len(planned) >= plan_best or over)) or (
                over and len(planned) >= plan_best):  # none fits: at most plan_best past it
            break
        began = time.perf_counter()
        step, peak, reason, parts = estimate_all(
            model, example_inputs, [trial.candidate], world=world, device=device,
            hardware=hardware, budget_s=max(budget_s, 60.0))[trial.candidate]
        last_s = time.perf_counter() - began
        log.info("zeroc.tune: planned %s in %.1f s", trial.candidate.label(), last_s)
        trial.estimated_s, trial.rejected = step, reason
        if peak is not None:
            trial.peak_bytes = peak
        if parts:
            trial.parts = parts
        if not trial.rejected and capacity and peak and peak > capacity:
            trial.rejected = f"needs {human_bytes(peak)} > {human_bytes(capacity)}"
        planned.append(trial)
        progress("planning", len(planned), max(len(planned), min(plan_best, len(alive))))
    if planned and len(planned) < min(plan_best, len(alive)):
        progress("planning", len(planned), len(planned))  # stopped by the budget: close the bar
    fitting = [t for t in planned if not t.rejected and t.estimated_s is not None]
    if not fitting:
        peaks = [t.peak_bytes for t in planned if t.peak_bytes]
        detail = (f"the smallest planned peak is {human_bytes(min(peaks))} against "
                  f"{human_bytes(capacity or 0)}" if peaks else
                  "; ".join(sorted({t.rejected for t in planned})))
        raise NothingFits(f"zeroc.tune: none of the screened candidates could be planned to "
                          f"fit on {device} for world={world}: {detail}", trials)
    best = min(fitting, key=lambda t: t.estimated_s)
    result = TuneResult(best.candidate, tuple(trials), False, path, measured=False)
    log.info("zeroc.tune: ranked world %d in %.1f s: %s\n%s", world,
             time.perf_counter() - start, result.why(), result.table())
    return result
