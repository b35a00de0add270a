"""Sections ``kernels`` and ``fused_loss``: zeroc's own kernels against eager and Inductor.

``kernels`` runs the kernel part of ``benchmarks/gpu_kernels.py``: softmax (forward and
backward), layer norm, RMS norm, GELU+bias and a cross-entropy style log-softmax at
``--kernel-rows`` x ``--kernel-cols`` in bf16, then fp32, each traced to an aten graph and
fused by zeroc with ``kernels="triton"``, timed with ``triton.testing.do_bench`` beside eager
and Inductor on the same graph and checked against eager; no pattern starts that the longest so
far says would end past the budget. Figures: every pattern's times, achieved GB/s and fraction
of the HBM bandwidth, and per dtype the geometric mean of zeroc's time over Inductor's and over
eager's. The check fails when a zeroc kernel's output does not match eager's.

``fused_loss`` times the language-model head and its loss at the training section's shape (rows
= batch x seq, the model's width and vocabulary, bf16 ``h`` and ``W``): eager
``F.cross_entropy(F.linear(h, W).float(), t)`` (what the GPT does under autocast), zeroc's
chunked ``zeroc::linear_cross_entropy`` (``zeroc.runtime.kernels.linear_cross_entropy``; its
per-chunk Triton kernel, ``zeroc.runtime.kernels.cross_entropy_triton``, on CUDA) and, on CUDA,
Inductor's ``torch.compile`` of the eager function. For each: forward + backward time (median
of interleaved repeats), the peak CUDA memory above the inputs, and the largest absolute
difference of the loss and of ``grad_h`` and ``grad_W`` from eager's and from a float32
reference. The check fails when the fused loss or a gradient differs from eager's by more than
``rtol * (largest magnitude of eager's)`` (rtol of the training section: 2e-2 in bf16).
"""

from __future__ import annotations

import gc
import logging
import math
import os
import statistics
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .runner import Budget, SkipSection, synchronize
from .train import TOLERANCE

logger = logging.getLogger(__name__)

LOSS_REPEATS = 10  # timed forward + backward passes of each fused-loss variant
LOSS_WARMUP = 2


def geomean(values: list[float | None]) -> float | None:
    """Geometric mean of the positive values among ``values`` (``None`` if there are none)."""
    present = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not present:
        return None
    return math.exp(sum(math.log(v) for v in present) / len(present))


def kernel_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per dtype: patterns timed, the geometric means of zeroc over Inductor and over eager,
    and the patterns whose zeroc output did not match eager's (or that failed)."""
    by_dtype: dict[str, dict[str, Any]] = {}
    for dtype in dict.fromkeys(r.get("dtype") for r in rows):
        mine = [r for r in rows if r.get("dtype") == dtype]
        by_dtype[str(dtype)] = {
            "patterns": len(mine),
            "zeroc_over_inductor_geomean": geomean([r.get("zeroc_over_inductor") for r in mine]),
            "zeroc_over_eager_geomean": geomean([r.get("zeroc_over_eager") for r in mine]),
            "mismatched_or_failed": [r["pattern"] for r in mine if not r.get("zeroc_ok")]}
    return by_dtype


def run_kernels(ctx: Any, budget: Budget) -> dict[str, Any]:
    """The ``kernels`` section (CUDA only)."""
    if not ctx.device.startswith("cuda"):
        raise SkipSection("zeroc's Triton kernels are timed on a CUDA device")
    import gpu_kernels

    opts = types.SimpleNamespace(rows=ctx.kernel_rows, cols=ctx.kernel_cols,
                                 cache_dir=os.path.join(ctx.cache_dir, "kernels"))
    hbm = gpu_kernels.resolve_hbm(ctx.device_name, None)
    result = gpu_kernels.run_kernels(opts, hbm["bytes_per_s"], budget)
    logger.info("kernels:\n%s", gpu_kernels.format_table(result["results"]))
    summary = kernel_summary(result["results"])
    bad = [f"{r['pattern']} {r.get('dtype')}" for r in result["results"] if not r.get("zeroc_ok")]
    return {"ok": not bad, "reason": f"zeroc output differs or failed: {', '.join(bad)}"
            if bad else None, "hbm": hbm, "summary": summary, **result}


def _eager_loss(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), t)


def _fused_loss(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    from zeroc.runtime.kernels.linear_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(h, w, None, t)


def loss_and_grads(fn: Callable, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fn``'s loss (float32) and the gradients of ``h`` and ``w``, from fresh leaves."""
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = fn(h, w, t)
    loss.backward()
    return loss.detach().float(), h.grad, w.grad


def max_abs_diffs(ours: tuple, reference: tuple) -> dict[str, float]:
    """Largest absolute difference of loss, ``grad_h`` and ``grad_w`` (in float32)."""
    return {name: float((a.float() - b.float()).abs().max())
            for name, a, b in zip(("loss", "grad_h", "grad_w"), ours, reference, strict=True)}


def diffs_within(diffs: dict[str, float], reference: tuple, dtype: torch.dtype) -> bool:
    """Each difference is at most ``rtol * (largest magnitude of eager's)``: relative, since
    the gradients of a mean over many rows are far below any absolute tolerance."""
    rtol = TOLERANCE[dtype][0]
    scales = [float(r.float().abs().max()) for r in reference]
    return all(math.isfinite(diffs[name]) and diffs[name] <= rtol * scale
               for name, scale in zip(("loss", "grad_h", "grad_w"), scales, strict=True))


def _peak_extra(fn: Callable, args: tuple, device: str) -> tuple[tuple, int | None]:
    """Run ``loss_and_grads`` once; the CUDA memory it took above what was allocated before."""
    gc.collect()
    synchronize(device)
    if not device.startswith("cuda"):
        return loss_and_grads(fn, *args), None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = loss_and_grads(fn, *args)
    synchronize(device)
    return out, int(torch.cuda.max_memory_allocated() - base)


def run_fused_loss(ctx: Any, budget: Budget) -> dict[str, Any]:
    """The ``fused_loss`` section."""
    from zeroc.runtime.kernels import linear_cross_entropy as lce

    device, dtype = ctx.device, ctx.dtype
    rows, width, vocab = ctx.batch * ctx.model.block_size, ctx.model.d_model, ctx.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(rows, width, generator=gen).to(device, dtype)
    w = (torch.randn(vocab, width, generator=gen) * width**-0.5).to(device, dtype)
    t = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    variants: dict[str, Callable] = {"eager": _eager_loss, "fused": _fused_loss}
    if device.startswith("cuda"):
        variants["inductor"] = torch.compile(_eager_loss)
    reference = loss_and_grads(_eager_loss, h.float(), w.float(), t)  # float32
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, tuple] = {}
    for name, fn in variants.items():
        try:
            loss_and_grads(fn, h, w, t)  # compiles Inductor's, outside the measured pass
            outputs[name], peak = _peak_extra(fn, (h, w, t), device)
            results[name] = {"peak_extra_bytes": peak, "times_s": [], "error": None,
                             "max_abs_diff_vs_fp32": max_abs_diffs(outputs[name], reference)}
        except Exception as error:  # recorded; the other variants still run
            logger.warning("fused_loss: %s failed", name, exc_info=True)
            results[name] = {"error": f"{type(error).__name__}: {error}", "times_s": []}
    reference = None
    live = [n for n in variants if results[n]["error"] is None]
    for repeat in range(LOSS_WARMUP + LOSS_REPEATS):  # interleaved; one timed round always
        timed = repeat >= LOSS_WARMUP
        if timed and budget.spent() and any(results[n]["times_s"] for n in live):
            break
        for name in live:
            synchronize(device)
            start = time.perf_counter()
            loss_and_grads(variants[name], h, w, t)
            synchronize(device)
            if timed:
                results[name]["times_s"].append(time.perf_counter() - start)
    for name in live:
        times = results[name]["times_s"]
        results[name]["median_s"] = statistics.median(times) if times else None
    problems = [f"{n} failed" for n in ("eager", "fused") if results[n]["error"]]
    eager_ms = results["eager"].get("median_s")
    for name in live:
        ours = results[name].get("median_s")
        results[name]["time_over_eager"] = ours / eager_ms if ours and eager_ms else None
        if name != "eager" and "eager" in outputs:
            diffs = max_abs_diffs(outputs[name], outputs["eager"])
            results[name]["max_abs_diff_vs_eager"] = diffs
            results[name]["agrees_with_eager"] = diffs_within(diffs, outputs["eager"], dtype)
            if name == "fused" and not results[name]["agrees_with_eager"]:
                problems.append(f"the fused loss differs from eager's: {diffs}")
    for name, r in results.items():
        logger.info("fused_loss: %-9s %s ms, peak +%s MiB, vs eager %s", name,
                    "n/a" if r.get("median_s") is None else f"{r['median_s'] * 1e3:.2f}",
                    "n/a" if r.get("peak_extra_bytes") is None
                    else f"{r['peak_extra_bytes'] / 2**20:.0f}",
                    r.get("max_abs_diff_vs_eager", r.get("error") or "-"))
    return {"ok": not problems, "reason": "; ".join(problems) or None,
            "rows": rows, "width": width, "vocab": vocab,
            "dtype": str(dtype).removeprefix("torch."),
            "chunk_rows": lce.chunk_rows_for(rows, width, vocab),
            "chunk_kernel": lce.chunk_kernel_for(torch.device(device)),
            "logits_bytes": rows * vocab * torch.finfo(dtype).bits // 8, "variants": results}
