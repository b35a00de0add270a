"""Section ``train``: the zoo GPT's training step as eager, Inductor and zeroc on one device.

Every variant is built from seed 0 and trains on the same batch (memorized, so the loss falls
step by step and a wrong gradient shows) with the same program: forward and loss under
``torch.autocast(bfloat16)`` (nothing in float32), backward, ``torch.optim.AdamW`` on the fp32
parameters, ``zero_grad``. The variants are ``gpu_step``'s (``eager``, ``inductor``:
``torch.compile(model)``, ``zeroc``: ``torch.compile(model, backend="zeroc")`` with its default
options, and on request ``zeroc_triton`` / ``zeroc_inductor``). All live at once: each takes
its first step (timed alone: it compiles), then ``warmup`` untimed and ``steps`` timed rounds
run round-robin, so clock and thermal drift fall on all alike; no round starts once the
section's budget is spent (one timed round always runs).

Figures per variant: first-step seconds, the median step, tokens/s, step time over eager's and
over Inductor's (below 1 is faster), achieved TFLOP/s and MFU (``flops``), and every step's
loss against eager's at the same step: they agree when ``|loss - eager| <= rtol * |eager| +
atol`` (rtol = atol = 2e-2 in bf16: bf16 keeps 8 significant bits and fused kernels round
differently over a dozen optimizer steps; 1e-3 / 1e-4 in float32). The check fails when eager
does not run, a variant raises, or a variant's losses disagree.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import gpu_step
import torch

from . import flops
from .runner import Budget

logger = logging.getLogger(__name__)

VARIANTS = gpu_step.VARIANTS
GPU_DEFAULT = ("eager", "inductor", "zeroc")
CPU_DEFAULT = ("eager", "zeroc")
TOLERANCE = gpu_step.LOSS_TOLERANCE


def compare_losses(losses: list[float] | None, reference: list[float] | None,
                   dtype: torch.dtype) -> dict[str, Any]:
    """Step-by-step agreement of ``losses`` with ``reference`` within ``TOLERANCE[dtype]``:
    ``{"agree", "max_abs_diff", "max_rel_diff", "reason"}``. Lengths must match; a NaN or an
    infinite loss never agrees."""
    rtol, atol = TOLERANCE[dtype]
    if not reference:
        return {"agree": False, "max_abs_diff": None, "max_rel_diff": None,
                "reason": "no eager losses to compare with (eager failed)"}
    if not losses or len(losses) != len(reference):
        return {"agree": False, "max_abs_diff": None, "max_rel_diff": None,
                "reason": f"{len(losses or [])} losses against eager's {len(reference)}"}
    diffs = [abs(a - b) for a, b in zip(losses, reference, strict=True)]
    agree = all(d <= rtol * abs(b) + atol for d, b in zip(diffs, reference, strict=True))
    finite = all(math.isfinite(v) for v in losses)
    rel = [d / max(abs(b), 1e-12) for d, b in zip(diffs, reference, strict=True)]
    ok = bool(agree and finite)
    return {"agree": ok, "max_abs_diff": max(diffs), "max_rel_diff": max(rel),
            "reason": None if ok else "outside the tolerance or not finite"}


def train_figures(variants: dict[str, dict[str, Any]], flops_per_step: float | None,
                  peak_flops: float | None, dtype: torch.dtype) -> dict[str, Any]:
    """Add achieved TFLOP/s, MFU and the step-by-step loss comparison to ``gpu_step``'s
    per-variant summaries (in place); return ``{"ok", "reason", "variants"}``.

    A variant's losses are compared with eager's over the steps both took (the rounds run all
    live variants, so a variant that ran throughout took as many as eager). A variant skipped
    for the budget is not a failure; one that raised is, as is a loss that disagrees."""
    eager = variants.get("eager", {})
    reference = eager.get("losses") if eager.get("ran") else None
    problems = [] if reference else ["eager did not run"]
    for name, summary in variants.items():
        summary["achieved_tflops"] = None
        achieved = flops.achieved_flops(flops_per_step, summary.get("step_median_s"))
        if achieved is not None:
            summary["achieved_tflops"] = achieved / 1e12
        summary["mfu"] = flops.mfu(flops_per_step, summary.get("step_median_s"), peak_flops)
        if summary.get("skipped"):
            summary["loss_comparison"] = None
            continue
        if summary.get("error") or not summary.get("ran"):
            problems.append(f"{name} failed ({summary.get('error')})")
            summary["loss_comparison"] = None
            continue
        losses = summary.get("losses") or []
        steps = min(len(losses), len(reference or []))
        comparison = compare_losses(losses[:steps], (reference or [])[:steps], dtype)
        summary["loss_comparison"] = comparison
        if not comparison["agree"]:
            problems.append(f"{name}'s losses disagree with eager's ({comparison['reason']})")
    return {"ok": not problems, "reason": "; ".join(problems) or None, "variants": variants}


def format_mfu(variants: dict[str, dict[str, Any]], peak: dict[str, Any]) -> str:
    """One line: each variant's MFU (or why it is unknown)."""
    if peak.get("peak_flops") is None:
        return f"MFU unknown: {peak.get('reason')}"
    parts = []
    for name, summary in variants.items():
        value = summary.get("mfu")
        parts.append(f"{name} {'n/a' if value is None else format(value, '.1%')}")
    return (f"MFU against {peak['peak_flops'] / 1e12:.1f} TFLOP/s ({peak.get('name')}): "
            + ", ".join(parts))


def run_train(ctx: Any, budget: Budget) -> dict[str, Any]:
    """The section: count the step's FLOPs, run the variants, summarize."""
    tokens, targets = ctx.batch_tensors()
    counted = flops.count_flops(ctx.model, ctx.device, ctx.dtype, tokens, targets)
    per_step = flops.step_flops(ctx.model, ctx.batch, counted)
    logger.info("train: model FLOPs per step %.4g TFLOP (%s); analytic %.4g TFLOP",
                per_step["used"] / 1e12, per_step["basis"], per_step["analytic"] / 1e12)
    setup = gpu_step.StepSetup(ctx.model, ctx.batch, ctx.steps, ctx.warmup, ctx.lr, ctx.device,
                               ctx.dtype, os.path.join(ctx.cache_dir, "train"))
    runs = gpu_step.run_variants(setup, list(ctx.configs), budget)
    summary = gpu_step.summarize(runs, setup)
    figures = train_figures(summary, per_step["used"], ctx.hardware.get("peak_flops"),
                            ctx.dtype)
    logger.info("train: median step over %d interleaved rounds\n%s", ctx.steps,
                gpu_step.format_step_table({"variants": summary}))
    logger.info("train: %s", format_mfu(summary, ctx.hardware))
    rtol, atol = TOLERANCE[ctx.dtype]
    params = next((r.parameters for r in runs if r.parameters is not None), None)
    return {**figures, "parameters": params, "tokens_per_step": ctx.batch * ctx.model.block_size,
            "flops_per_step": per_step, "peak": ctx.hardware,
            "loss_tolerance": {"rtol": rtol, "atol": atol,
                               "rule": "|loss - eager| <= rtol * |eager| + atol at every step"}}
