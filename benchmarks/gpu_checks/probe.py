"""Instrumented training runs, and the sections ``zero3``, ``memory`` and ``syncs`` on them.

A probe trains one configuration of the zoo GPT for ``--probe-steps`` steps (seed 0, the
training section's batch and AdamW): ``eager`` (under autocast), ``zeroc``
(``torch.compile(model, backend="zeroc")``, pp = 1, no ``parallelize``) or ``zeroc_zero3``
(``zeroc.parallelize(model, zero=3)`` on the world-1 process group first: NCCL on a GPU, gloo
on the CPU, over a ``FileStore`` in the run's directory; bf16 runs use
``zeroc.MixedPrecision(param_dtype=torch.bfloat16)`` without autocast, or autocast with
``--zero3-precision autocast``). It records every step's loss and wall time, the CUDA memory
(``torch.cuda.max_memory_allocated`` since just before the model was built, less what was
allocated then), the plan's per-rank memory estimate (``zeroc.explain(compiled).memory``:
params + grads + Adam state + activations = peak) and, on CUDA, the host synchronizations of
the steady steps ``SYNC_STEPS`` (3, 4 and 5, counting from 0: the first step compiles): each
runs with ``torch.cuda.set_sync_debug_mode("warn")`` inside ``warnings.catch_warnings(
record=True)`` and the warnings saying "called a synchronizing CUDA operation" are counted,
with the source lines they point at. Losses are read only after the counted steps, so the
probe adds no synchronization of its own (NCCL calls are not covered by torch's sync debug
mode). Each probe runs once per check; the sections share them.

- ``zero3``: eager and ``zeroc_zero3`` probes; every step's loss agrees with eager's within
  the training section's tolerance; steady step times and their ratio.
- ``memory``: the ``zeroc`` probe's measured peak against the plan's (and ``zeroc_zero3``'s
  when section ``zero3`` ran), their ratio and the plan's breakdown.
- ``syncs``: host syncs per counted step of ``eager``, ``zeroc`` and ``zeroc_zero3``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import statistics
import time
import traceback
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from models.gpt import GPT

from . import flops
from .runner import Budget, SkipSection, release_memory, synchronize
from .train import compare_losses

logger = logging.getLogger(__name__)

SYNC_MESSAGE = "synchronizing CUDA operation"
SYNC_STEPS = (3, 4, 5)
PROBE_CONFIGS = ("eager", "zeroc", "zeroc_zero3")


def count_sync_warnings(records: Iterable[Any]) -> dict[str, Any]:
    """``{"syncs", "sources", "other_warnings"}`` of recorded warnings: how many say "called a
    synchronizing CUDA operation", the ten source lines (``file:line``) most of them point at,
    and how many others there were."""
    sources: collections.Counter[str] = collections.Counter()
    syncs = other = 0
    for record in records:
        if SYNC_MESSAGE in str(record.message):
            syncs += 1
            sources[f"{record.filename}:{record.lineno}"] += 1
        else:
            other += 1
    return {"syncs": syncs, "sources": dict(sources.most_common(10)), "other_warnings": other}


class SyncCounter:
    """While inside (when ``enabled``): sync debug mode ``"warn"`` and every warning recorded;
    afterwards ``result`` is ``count_sync_warnings`` of them (``None`` when not enabled)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.result: dict[str, Any] | None = None

    def __enter__(self) -> SyncCounter:
        if self.enabled:
            self._catch = warnings.catch_warnings(record=True)
            self._records = self._catch.__enter__()
            warnings.simplefilter("always")
            self._previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            try:
                torch.cuda.set_sync_debug_mode(self._previous)
            finally:
                self._catch.__exit__(*exc)
            self.result = count_sync_warnings(self._records)


def ensure_group(ctx: Any) -> dict[str, Any]:
    """The world-1 process group (initialized once, over a ``FileStore``), as a record."""
    if "group" in ctx.memo:
        return ctx.memo["group"]
    backend = "nccl" if ctx.device.startswith("cuda") else "gloo"
    path = os.path.join(ctx.cache_dir, "world1.store")
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.FileStore(path, 1), rank=0, world_size=1)
    ctx.memo["group"] = {"backend": dist.get_backend(), "world_size": dist.get_world_size(),
                         "store": "FileStore"}
    return ctx.memo["group"]


@dataclasses.dataclass
class Probe:
    """One probe's record; ``None`` where it did not get there."""

    config: str
    losses: list[float] = dataclasses.field(default_factory=list)
    step_s: list[float] = dataclasses.field(default_factory=list)
    steady_median_s: float | None = None
    baseline_bytes: int | None = None
    peak_bytes: int | None = None
    at_rest_bytes: int | None = None
    plan_memory: list[dict[str, int]] | None = None
    plan_error: str | None = None
    syncs: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)


def memory_figures(probe: Probe) -> dict[str, Any]:
    """The measured peak (above the baseline) against the plan's per-rank peak, and both."""
    plan_peak = max((row["peak"] for row in probe.plan_memory or []), default=None)
    ratio = probe.peak_bytes / plan_peak if probe.peak_bytes and plan_peak else None
    return {"measured_peak_bytes": probe.peak_bytes, "plan_peak_bytes": plan_peak,
            "measured_over_plan": ratio, "baseline_bytes": probe.baseline_bytes,
            "at_rest_bytes": probe.at_rest_bytes, "plan_memory": probe.plan_memory,
            "plan_error": probe.plan_error}


def _build(ctx: Any, config: str) -> tuple[torch.nn.Module, Any, Any]:
    """The model, what a step calls, and the autocast factory of ``config``."""
    model = GPT(ctx.model, seed=0).to(ctx.device)
    amp = lambda: flops.autocast(ctx.device, ctx.dtype)  # a fresh one per step
    if config == "eager":
        return model, model, amp
    import zeroc

    if config == "zeroc_zero3":
        ensure_group(ctx)
        policy = None
        if ctx.dtype != torch.float32 and ctx.zero3_precision == "mixed":
            policy, amp = zeroc.MixedPrecision(param_dtype=ctx.dtype), contextlib.nullcontext
        zeroc.parallelize(model, zero=3, mixed_precision=policy)
    options = {"cache_dir": os.path.join(ctx.cache_dir, "zeroc")}
    return model, torch.compile(model, backend="zeroc", options=options), amp


def _fmt(value: float | None, scale: float) -> str:
    return "n/a" if value is None else f"{value * scale:.2f}"


def run_probe(ctx: Any, config: str) -> Probe:
    """Train ``config`` for ``ctx.probe_steps`` steps and record it (raises on failure)."""
    cuda = ctx.device.startswith("cuda")
    probe = Probe(config)
    release_memory()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        probe.baseline_bytes = int(torch.cuda.memory_allocated())
    tokens, targets = ctx.batch_tensors()
    model, run, amp = _build(ctx, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ctx.lr)
    losses = []
    for step in range(ctx.probe_steps):
        synchronize(ctx.device)
        start = time.perf_counter()
        with SyncCounter(cuda and step in SYNC_STEPS) as counter:
            with amp():
                loss = run(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        synchronize(ctx.device)
        probe.step_s.append(time.perf_counter() - start)
        losses.append(loss.detach())
        if counter.result is not None:
            probe.syncs[step] = counter.result
    probe.losses = [float(loss.float()) for loss in losses]
    steady = probe.step_s[max(SYNC_STEPS) + 1:] or probe.step_s[1:]
    probe.steady_median_s = statistics.median(steady) if steady else None
    if cuda:
        probe.peak_bytes = int(torch.cuda.max_memory_allocated()) - probe.baseline_bytes
        probe.at_rest_bytes = int(torch.cuda.memory_allocated()) - probe.baseline_bytes
    if config != "eager":
        try:
            import zeroc

            probe.plan_memory = [dataclasses.asdict(m) for m in zeroc.explain(run).memory]
        except Exception as error:  # the measured figures stand without the plan's
            probe.plan_error = f"{type(error).__name__}: {error}"
    plan_peak = memory_figures(probe)["plan_peak_bytes"]
    logger.info("probe %s: losses %s, steady step %s ms, peak %s MiB, plan's peak %s MiB",
                config, [round(v, 4) for v in probe.losses], _fmt(probe.steady_median_s, 1e3),
                _fmt(probe.peak_bytes, 2.0**-20), _fmt(plan_peak, 2.0**-20))
    return probe


def probe(ctx: Any, config: str, budget: Budget | None = None) -> Probe:
    """The probe of ``config``, run on first use (when ``budget`` is not spent) and kept; a
    probe that failed raises again, naming the first failure."""
    memo = ctx.memo.setdefault("probes", {})
    if config not in memo:
        if budget is not None and budget.spent():
            raise SkipSection(f"budget spent before the {config} probe could start")
        try:
            memo[config] = run_probe(ctx, config)
        except Exception as error:
            memo[config] = (error, traceback.format_exc())
            raise
    found = memo[config]
    if isinstance(found, tuple):
        raise RuntimeError(f"the {config} probe failed: {type(found[0]).__name__}: {found[0]}")
    return found


def run_zero3(ctx: Any, budget: Budget) -> dict[str, Any]:
    """The ``zero3`` section."""
    group = ensure_group(ctx)
    eager = probe(ctx, "eager", budget)
    zero3 = probe(ctx, "zeroc_zero3", budget)
    comparison = compare_losses(zero3.losses, eager.losses, ctx.dtype)
    ratio = (zero3.steady_median_s / eager.steady_median_s
             if zero3.steady_median_s and eager.steady_median_s else None)
    return {"ok": comparison["agree"], "reason": None if comparison["agree"] else
            f"ZeRO-3 losses disagree with eager's ({comparison['reason']})",
            "process_group": group, "precision": ctx.zero3_precision,
            "steps": ctx.probe_steps, "loss_comparison": comparison,
            "eager_losses": eager.losses, "zero3_losses": zero3.losses,
            "eager_steady_step_s": eager.steady_median_s,
            "zero3_steady_step_s": zero3.steady_median_s, "zero3_time_over_eager": ratio,
            "zero3_step_s": zero3.step_s, "memory": memory_figures(zero3)}


def run_memory(ctx: Any, budget: Budget) -> dict[str, Any]:
    """The ``memory`` section (``zeroc_zero3`` only when an earlier section probed it)."""
    figures = {"zeroc": memory_figures(probe(ctx, "zeroc", budget))}
    found = ctx.memo.get("probes", {}).get("zeroc_zero3")
    if isinstance(found, Probe):
        figures["zeroc_zero3"] = memory_figures(found)
    measured = ctx.device.startswith("cuda")
    missing = [name for name, f in figures.items()
               if f["plan_peak_bytes"] is None or (measured and f["measured_peak_bytes"] is None)]
    return {"ok": not missing, "reason": f"no figure for {', '.join(missing)}" if missing
            else None, "measured": "torch.cuda.max_memory_allocated" if measured else
            "not measured: no CUDA allocator on the CPU", "configs": figures}


def sync_figures(found: Probe) -> dict[str, Any]:
    """Syncs per counted step, their largest count and the source lines over all of them."""
    per_step = {str(step): r["syncs"] for step, r in sorted(found.syncs.items())}
    sources: collections.Counter[str] = collections.Counter()
    for result in found.syncs.values():
        sources.update(result["sources"])
    return {"per_step": per_step, "max_per_step": max(per_step.values(), default=None),
            "sources": dict(sources.most_common(10))}


def run_syncs(ctx: Any, budget: Budget) -> dict[str, Any]:
    """The ``syncs`` section (CUDA only)."""
    if not ctx.device.startswith("cuda"):
        raise SkipSection("torch.cuda.set_sync_debug_mode needs a CUDA device")
    figures: dict[str, Any] = {}
    failed = []
    for config in PROBE_CONFIGS:
        try:
            figures[config] = sync_figures(probe(ctx, config, budget))
        except SkipSection as skip:
            figures[config] = {"skipped": str(skip)}
        except Exception as error:  # recorded; the other configurations still count
            figures[config] = {"error": f"{type(error).__name__}: {error}"}
            failed.append(config)
        logger.info("syncs: %s %s", config, figures[config])
    return {"ok": not failed, "reason": f"no counts for {', '.join(failed)}" if failed else None,
            "steps": list(SYNC_STEPS), "configs": figures}
