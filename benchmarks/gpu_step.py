"""The zoo GPT's full training step timed side by side for ``benchmarks/gpu_kernels.py``.

One step is forward and loss under ``torch.autocast(<device>, bfloat16)``, backward, and
``torch.optim.AdamW`` on the fp32 parameters (the master copy), then ``zero_grad``: the same
program in every variant, which only changes how the model is compiled:

- ``eager``: plain PyTorch;
- ``inductor``: ``torch.compile(model)`` (the default Inductor backend);
- ``zeroc_triton``: ``torch.compile(model, backend="zeroc", options={"kernels": "triton"})``;
- ``zeroc_inductor``: the same with ``{"kernels": "inductor"}`` (Inductor compiles zeroc's
  graphs);
- ``zeroc``: zeroc's default options (on the CPU the fused groups run as aten ops); used by
  ``--cpu-smoke``.

Every variant's model is built from seed 0 and trains on the same batch (memorized, so the loss
falls step by step and a wrong gradient shows). All variants live at once: each takes its first
step (timed alone: it compiles), then ``warmup`` untimed rounds and ``steps`` timed rounds run
round-robin (round r starts at variant r mod k), so clock and thermal drift fall on all alike.
A step's time is wall time between two device synchronizations. A variant that raises is
recorded with its error and leaves the rotation; the others go on. No first step starts
unless the longest first step so far would still end within the budget, and no round starts
once it is spent (one timed round always runs, so every compiled variant has a figure).
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                 "tests")))
from models.gpt import GPT, GPTConfig, random_token_batch  # noqa: E402

VARIANTS = ("eager", "inductor", "zeroc_triton", "zeroc_inductor", "zeroc")
GPU_VARIANTS = ("eager", "inductor", "zeroc_triton", "zeroc_inductor")
CPU_VARIANTS = ("eager", "zeroc")
CPU_INDUCTOR_VARIANTS = ("inductor", "zeroc_inductor")
ZEROC_OPTIONS = {"zeroc_triton": {"kernels": "triton"}, "zeroc_inductor": {"kernels": "inductor"},
                 "zeroc": {}}
# Sizing defaults on the GPU (about 186M parameters) and under --cpu-smoke.
GPU_SIZE = {"d_model": 1024, "n_layer": 12, "n_head": 16, "seq": 1024, "vocab": 32768,
            "batch": 8, "steps": 20, "warmup": 2}
SMOKE_SIZE = {"d_model": 32, "n_layer": 1, "n_head": 2, "seq": 16, "vocab": 64, "batch": 2,
              "steps": 3, "warmup": 1}
# dtype -> (rtol, atol) of the final-loss comparison with eager (as benchmarks/gpu_check.py).
LOSS_TOLERANCE = {torch.bfloat16: (2e-2, 2e-2), torch.float32: (1e-3, 1e-4)}


class Budget:
    """Seconds since construction against a limit; a limit of 0 or less never runs out."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since the budget started."""
        return time.perf_counter() - self.start

    def spent(self, estimate_s: float = 0.0) -> bool:
        """Whether no new work should start: the limit is reached, or work expected to take
        ``estimate_s`` (e.g. the longest like it so far) would end past it."""
        return self.seconds > 0 and self.elapsed() + estimate_s >= self.seconds


@dataclass(frozen=True)
class StepSetup:
    """What every variant trains, and where."""

    model: GPTConfig
    batch: int
    steps: int
    warmup: int
    lr: float
    device: str
    dtype: torch.dtype
    cache_dir: str


@dataclass
class VariantRun:
    """One variant's record; times in seconds, ``None`` where it did not get there."""

    name: str
    first_step_s: float | None = None
    step_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    error: str | None = None
    traceback: str | None = None
    skipped: str | None = None
    parameters: int | None = None
    state: Any = field(default=None, repr=False)  # (model, callable, optimizer) while live


def default_variants(cpu: bool, cpu_inductor: bool) -> list[str]:
    """The variants run by default: the four GPU ones, or eager and zeroc on the CPU (with the
    Inductor ones too when ``cpu_inductor``)."""
    if not cpu:
        return list(GPU_VARIANTS)
    return list(CPU_VARIANTS) + (list(CPU_INDUCTOR_VARIANTS) if cpu_inductor else [])


def tokens_per_s(tokens: int, step_s: float | None) -> float | None:
    """Tokens trained per second at ``step_s`` seconds a step (``None`` without a time)."""
    return tokens / step_s if step_s else None


def time_ratios(medians: dict[str, float | None]) -> dict[str, dict[str, float | None]]:
    """Each variant's median step time over eager's and over Inductor's (below 1 is faster);
    ``None`` where either time is missing."""
    def over(name: str, reference: str) -> float | None:
        ours, theirs = medians.get(name), medians.get(reference)
        return ours / theirs if ours is not None and theirs else None

    return {name: {"over_eager": over(name, "eager"), "over_inductor": over(name, "inductor")}
            for name in medians}


def losses_agree(loss: float | None, reference: float | None, dtype: torch.dtype
                 ) -> bool | None:
    """``|loss - reference| <= rtol * |reference| + atol`` (``LOSS_TOLERANCE[dtype]``); ``None``
    when either is missing; NaN never agrees."""
    if loss is None or reference is None:
        return None
    rtol, atol = LOSS_TOLERANCE[dtype]
    return bool(abs(loss - reference) <= rtol * abs(reference) + atol)


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _autocast(setup: StepSetup) -> contextlib.AbstractContextManager:
    if setup.dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(setup.device).type, dtype=setup.dtype)


def build_variant(name: str, setup: StepSetup) -> tuple[torch.nn.Module, Any]:
    """A fresh model from seed 0 on the device and the callable that variant ``name`` runs."""
    model = GPT(setup.model, seed=0).to(setup.device)
    if name == "eager":
        return model, model
    if name == "inductor":
        return model, torch.compile(model)
    if name in ZEROC_OPTIONS:
        options = {**ZEROC_OPTIONS[name], "cache_dir": os.path.join(setup.cache_dir, name)}
        return model, torch.compile(model, backend="zeroc", options=options)
    raise ValueError(f"variant {name!r} is not known; known: {', '.join(VARIANTS)}")


def _step(run: VariantRun, setup: StepSetup, tokens: torch.Tensor, targets: torch.Tensor
          ) -> float:
    """One training step of ``run``; records its loss, returns its wall time."""
    _, fn, optimizer = run.state
    _synchronize(setup.device)
    start = time.perf_counter()
    with _autocast(setup):
        loss = fn(tokens, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _synchronize(setup.device)
    elapsed = time.perf_counter() - start
    run.losses.append(float(loss.detach().float()))
    return elapsed


def _fail(run: VariantRun, error: Exception) -> None:
    first_line = str(error).splitlines()[0] if str(error) else ""
    run.error = f"{type(error).__name__}: {first_line}"
    run.traceback = traceback.format_exc()
    run.state = None
    print(f"step: {run.name} failed:\n{run.traceback}", file=sys.stderr, flush=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_variants(setup: StepSetup, variants: list[str], budget: Budget) -> list[VariantRun]:
    """Build every variant, take each one's first step, then the interleaved rounds."""
    cfg = setup.model  # the batch GPT.example_batch(batch_size=setup.batch, seed=0) returns
    tokens, targets = random_token_batch(cfg.vocab_size, cfg.block_size, setup.batch, None, 0)
    tokens, targets = tokens.to(setup.device), targets.to(setup.device)
    runs = [VariantRun(name) for name in variants]
    for run in runs:
        longest = max((r.first_step_s for r in runs if r.first_step_s is not None), default=0.0)
        if budget.spent(longest):
            run.skipped = (f"budget of {budget.seconds:g} s: no time left for its first step "
                           f"(the longest so far took {longest:.0f} s)")
            continue
        try:
            model, fn = build_variant(run.name, setup)
            run.parameters = sum(p.numel() for p in model.parameters())
            run.state = (model, fn, torch.optim.AdamW(model.parameters(), lr=setup.lr))
            run.first_step_s = _step(run, setup, tokens, targets)
            print(f"step: {run.name} first step (compile) {run.first_step_s:.2f} s", flush=True)
        except Exception as error:  # a failing variant is reported, the others still run
            _fail(run, error)
    for round_ in range(setup.warmup + setup.steps):
        live = [run for run in runs if run.state is not None]
        if not live:
            break
        timed, last = round_ >= setup.warmup, False
        if budget.spent():
            if any(run.step_s for run in live):
                break
            timed = last = True  # the one timed round that always runs
        shift = round_ % len(live)
        for run in live[shift:] + live[:shift]:
            try:
                elapsed = _step(run, setup, tokens, targets)
            except Exception as error:
                _fail(run, error)
                continue
            if timed:
                run.step_s.append(elapsed)
        if last:
            break
    for run in runs:
        run.state = None
    gc.collect()
    return runs


def summarize(runs: list[VariantRun], setup: StepSetup) -> dict[str, Any]:
    """Per variant: first step, median step, tokens/s, ratios to eager and Inductor, the final
    loss and whether it agrees with eager's after as many steps (``n/a`` fields are ``None``)."""
    tokens = setup.batch * setup.model.block_size
    medians = {r.name: statistics.median(r.step_s) if r.step_s else None for r in runs}
    ratios = time_ratios(medians)
    by_name = {r.name: r for r in runs}
    eager = by_name.get("eager")
    summary: dict[str, Any] = {}
    for run in runs:
        final = run.losses[-1] if run.losses else None
        reference = None
        if eager is not None and run.losses and len(eager.losses) >= len(run.losses):
            reference = eager.losses[len(run.losses) - 1]
        ok = run.error is None and run.skipped is None and medians[run.name] is not None
        summary[run.name] = {
            "ran": ok, "error": run.error, "skipped": run.skipped, "traceback": run.traceback,
            "first_step_s": run.first_step_s, "step_median_s": medians[run.name],
            "steps_timed": len(run.step_s), "step_s": run.step_s,
            "tokens_per_s": tokens_per_s(tokens, medians[run.name]),
            **ratios[run.name], "final_loss": final, "eager_loss_same_step": reference,
            "loss_agrees": losses_agree(final, reference, setup.dtype), "losses": run.losses}
    return summary


def run_step_comparison(setup: StepSetup, variants: list[str], budget: Budget
                        ) -> dict[str, Any]:
    """The JSON section of the step comparison: its setup, each variant's summary, and the
    variants whose final loss disagrees with eager's."""
    runs = run_variants(setup, variants, budget)
    summary = summarize(runs, setup)
    cfg = setup.model
    params = next((r.parameters for r in runs if r.parameters is not None), None)
    mismatched = [n for n, s in summary.items() if s["loss_agrees"] is False]
    if mismatched:
        print(f"step: final loss disagrees with eager's for {', '.join(mismatched)}",
              file=sys.stderr, flush=True)
    return {"device": setup.device, "dtype": str(setup.dtype).removeprefix("torch."),
            "d_model": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "seq": cfg.block_size, "vocab": cfg.vocab_size, "batch": setup.batch,
            "parameters": params, "tokens_per_step": setup.batch * cfg.block_size,
            "steps": setup.steps, "warmup": setup.warmup, "lr": setup.lr,
            "loss_tolerance": dict(zip(("rtol", "atol"), LOSS_TOLERANCE[setup.dtype],
                                       strict=True)),
            "variants": summary, "loss_mismatch": mismatched}


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, spec)


def format_step_table(section: dict[str, Any]) -> str:
    """The step comparison as a fixed-width text table (``n/a`` where a figure is missing; the
    column of ratios to Inductor only when Inductor was among the variants)."""
    with_inductor = "inductor" in section["variants"]
    head = (f"{'variant':<16}{'first s':>9}{'step ms':>10}{'tokens/s':>12}{'/eager':>8}"
            + (f"{'/inductor':>10}" if with_inductor else "") + f"{'final loss':>12}"
            "  loss vs eager")
    lines = [head, "-" * len(head)]
    for name, s in section["variants"].items():
        agree = {True: "agrees", False: "MISMATCH", None: "n/a"}[s["loss_agrees"]]
        line = (f"{name:<16}{_fmt(s['first_step_s'], '.2f'):>9}"
                f"{_fmt(s['step_median_s'], '.2f', 1e3):>10}{_fmt(s['tokens_per_s'], '.0f'):>12}"
                f"{_fmt(s['over_eager'], '.2f'):>8}"
                + (f"{_fmt(s['over_inductor'], '.2f'):>10}" if with_inductor else "")
                + f"{_fmt(s['final_loss'], '.4f'):>12}  {agree}")
        why = s["error"] or s["skipped"]
        lines.append(line + (f"  ({why})" if why else ""))
    return "\n".join(lines)
