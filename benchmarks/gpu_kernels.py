"""Benchmark zeroc on one CUDA GPU: the zoo GPT's training step, and zeroc's fused kernels.

Two parts, both against eager PyTorch and ``torch.compile``'s default Inductor, unattended and
within ``--budget-s`` (270 s from the start of ``main``: no variant, step round or pattern
starts that the longest one like it so far says would end past it, so the defaults end within
5 minutes on an H200, compiles included):

- ``step`` (``benchmarks/gpu_step.py``): the zoo GPT (width 1024, 12 layers, 16 heads,
  sequence 1024, vocab 32768, batch 8: 186M parameters) trains with the full step (forward
  under ``torch.autocast(cuda, bfloat16)``, backward, AdamW on the fp32 parameters) as eager,
  Inductor, zeroc ``kernels="triton"`` and zeroc ``kernels="inductor"``. Reported: the first
  step (compile) time, the median of ``--steps`` interleaved steps, tokens/s, step time over
  eager's and over Inductor's, and each final loss against eager's (bf16 tolerance; a mismatch
  is reported, a failing variant shows as n/a with its error).
- ``kernels``: softmax (forward and backward), layer norm, RMS norm, GELU+bias and a
  cross-entropy style log-softmax, at ``--rows`` x ``--cols`` in bf16 and fp32, each traced to
  an aten graph, fused by zeroc with ``kernels="triton"`` (default launch configurations) and
  timed with ``triton.testing.do_bench`` next to eager and Inductor, checked against eager. Each
  time also gives the achieved bandwidth: bytes moved (inputs plus outputs) / time, in GB/s
  and as a fraction of the device's HBM bandwidth, which comes from zeroc's hardware profile
  of ``torch.cuda.get_device_name()`` (``zeroc.runtime.cost.hardware``), else ``--hbm-gbps``, else
  it is "unknown".

Tables are printed; everything is written as JSON to ``--out``:

    python benchmarks/gpu_kernels.py --out $OUT/gpu_kernels.json

Exit status 0 when every part that ran is correct (every variant and pattern ran, losses and
outputs agree), else 1. Without CUDA it prints why and exits 0, writing ``{"skipped": ...}``,
unless ``--cpu-smoke``: then the step part runs tiny on the CPU with eager and zeroc's default
(aten) path (``--cpu-inductor`` adds the Inductor variants: slow C++ compiles), to test the
script:

    python benchmarks/gpu_kernels.py --cpu-smoke --out /tmp/gpu_kernels.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import traceback
import types
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_step  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w


def patterns(rows: int, cols: int, dtype: torch.dtype, device: str) -> dict:
    """name -> (function, example inputs)."""
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    x, g = randn(rows, cols), randn(rows, cols)
    w, b = randn(cols), randn(cols)
    y = torch.softmax(x.float(), -1).to(dtype)
    return {
        "softmax": (lambda x: torch.softmax(x, -1), (x,)),
        "softmax_bw": (lambda g, y: torch.ops.aten._softmax_backward_data(g, y, -1, dtype),
                       (g, y)),
        "layernorm": (lambda x, w, b: F.layer_norm(x, (cols,), w, b), (x, w, b)),
        "rmsnorm": (_rmsnorm, (x, w)),
        "gelu_bias": (lambda x, b: F.gelu(x + b), (x, b)),
        "log_softmax_ce": (lambda x: torch.log_softmax(x.float(), -1), (x,)),
    }


def zeroc_compile(fn, args: tuple, cache_dir: str):
    """Trace ``fn`` to aten, fuse it with Triton kernels; return (callable, kernel count)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from zeroc.passes.base import PassContext
    from zeroc.passes.fusion import fusion

    gm = make_fx(fn, tracing_mode="fake")(*args)
    config = types.SimpleNamespace(kernels="triton", cache_dir=cache_dir)
    ctx = PassContext(config, fn.__name__, "inference", device=args[0].device)
    gm = fusion(gm, ctx).gm
    return gm, len(ctx.kernels)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float]:
    err = ((a.float() - b.float()).abs() / (1 + b.float().abs())).max().item()
    return err <= TOLERANCE[dtype], err


def tensor_bytes(*values: Any) -> int:
    """Bytes held by the tensors among ``values`` (searched through tuples and lists)."""
    total = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, (tuple, list)):
            total += tensor_bytes(*value)
    return total


def bandwidth(nbytes: int, ms: float | None, hbm_bytes_per_s: float | None
              ) -> tuple[float | None, float | None]:
    """(achieved GB/s, fraction of the HBM bandwidth) of moving ``nbytes`` in ``ms``
    milliseconds (1 GB = 1e9 bytes); ``None`` where the time or the bandwidth is unknown."""
    if not ms or ms <= 0:
        return None, None
    bytes_per_s = nbytes / (ms * 1e-3)
    return bytes_per_s / 1e9, (bytes_per_s / hbm_bytes_per_s if hbm_bytes_per_s else None)


def resolve_hbm(device_name: str | None, hbm_gbps: float | None) -> dict[str, Any]:
    """The device's HBM bandwidth: ``{"bytes_per_s", "source"}`` from zeroc's hardware profile
    of ``device_name``, else from ``--hbm-gbps``, else ``bytes_per_s`` ``None`` and source
    ``"unknown"`` (with the reason). Never raises."""
    reason = "no CUDA device name" if device_name is None else None
    if device_name is not None:
        try:
            from zeroc.runtime.cost.hardware import profile_for_device_name

            profile = profile_for_device_name(device_name)
            if profile is not None:
                return {"bytes_per_s": float(profile.memory_bytes_per_s),
                        "source": f"zeroc hardware profile {profile.name!r}"}
            reason = f"no zeroc hardware profile matches {device_name!r}"
        except Exception as error:  # the profile is optional: fall back to the flag
            reason = f"zeroc.runtime.cost.hardware failed ({type(error).__name__}: {error})"
    if hbm_gbps:
        return {"bytes_per_s": hbm_gbps * 1e9, "source": "--hbm-gbps", "reason": reason}
    return {"bytes_per_s": None, "source": "unknown", "reason": f"{reason}; pass --hbm-gbps"}


def bench_one(name: str, fn, args: tuple, dtype: torch.dtype, cache_dir: str,
              hbm_bytes_per_s: float | None) -> dict:
    """Time eager, Inductor and zeroc for one pattern; check zeroc and Inductor vs eager; give
    each one's achieved bandwidth."""
    from triton.testing import do_bench

    zeroc_fn, n_kernels = zeroc_compile(fn, args, cache_dir)
    inductor_fn = torch.compile(fn, backend="inductor")
    ref = fn(*args)
    ok_z, err_z = _close(zeroc_fn(*args), ref, dtype)
    ok_i, err_i = _close(inductor_fn(*args), ref, dtype)
    nbytes = tensor_bytes(args, ref)
    row = {"pattern": name, "dtype": str(dtype).removeprefix("torch."),
           "shape": list(args[0].shape), "zeroc_kernels": n_kernels, "bytes_moved": nbytes}
    for label, f in (("eager", fn), ("inductor", inductor_fn), ("zeroc", zeroc_fn)):
        ms = do_bench(lambda f=f: f(*args), warmup=25, rep=100)
        gbps, fraction = bandwidth(nbytes, ms, hbm_bytes_per_s)
        row.update({f"{label}_ms": ms, f"{label}_gbps": gbps, f"{label}_hbm_fraction": fraction})
    row.update({"zeroc_over_inductor": row["zeroc_ms"] / row["inductor_ms"],
                "zeroc_over_eager": row["zeroc_ms"] / row["eager_ms"],
                "zeroc_ok": ok_z, "zeroc_err": err_z, "inductor_ok": ok_i, "inductor_err": err_i,
                "error": None})
    return row


def run_kernels(opts: argparse.Namespace, hbm_bytes_per_s: float | None,
                budget: gpu_step.Budget) -> dict[str, Any]:
    """Every pattern in bf16 then fp32 while the longest pattern so far would still end within
    the budget; a failing one is a row with its error and no times."""
    rows, left_out, longest = [], [], 0.0
    for dtype in (torch.bfloat16, torch.float32):
        for name, (fn, args) in patterns(opts.rows, opts.cols, dtype, "cuda").items():
            label = f"{name} {str(dtype).removeprefix('torch.')}"
            if budget.spent(longest):
                left_out.append(label)
                continue
            fn.__name__ = name
            start = budget.elapsed()
            try:
                rows.append(bench_one(name, fn, args, dtype, opts.cache_dir, hbm_bytes_per_s))
                longest = max(longest, budget.elapsed() - start)
            except Exception as error:  # reported as n/a, the other patterns still run
                print(f"kernels: {label} failed:\n{traceback.format_exc()}", file=sys.stderr)
                rows.append({"pattern": name, "dtype": str(dtype).removeprefix("torch."),
                             "zeroc_ok": False, "error": f"{type(error).__name__}: {error}"})
            print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    if left_out:
        print(f"kernels: budget spent, left out {', '.join(left_out)}", file=sys.stderr)
    return {"rows": opts.rows, "cols": opts.cols, "results": rows, "left_out": left_out}


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, spec)


def format_table(rows: list[dict]) -> str:
    """The kernel results as a fixed-width text table (``n/a`` where a figure is missing)."""
    head = (f"{'pattern':<16}{'dtype':<10}{'eager ms':>10}{'inductor ms':>13}{'zeroc ms':>10}"
            f"{'z/ind':>8}{'z/eager':>9}{'eager GB/s':>12}{'ind GB/s':>10}{'zeroc GB/s':>12}"
            f"{'z %HBM':>8}  match")
    lines = [head, "-" * len(head)]
    for r in rows:
        match = "n/a" if r.get("error") else (
            f"{'yes' if r['zeroc_ok'] else 'NO'} ({r['zeroc_err']:.1e})")
        lines.append(f"{r['pattern']:<16}{r['dtype']:<10}{_fmt(r.get('eager_ms'), '.3f'):>10}"
                     f"{_fmt(r.get('inductor_ms'), '.3f'):>13}{_fmt(r.get('zeroc_ms'), '.3f'):>10}"
                     f"{_fmt(r.get('zeroc_over_inductor'), '.2f'):>8}"
                     f"{_fmt(r.get('zeroc_over_eager'), '.2f'):>9}"
                     f"{_fmt(r.get('eager_gbps'), '.0f'):>12}"
                     f"{_fmt(r.get('inductor_gbps'), '.0f'):>10}"
                     f"{_fmt(r.get('zeroc_gbps'), '.0f'):>12}"
                     f"{_fmt(r.get('zeroc_hbm_fraction'), '.1f', 100):>8}  {match}"
                     + (f" {r['error']}" if r.get("error") else ""))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options; the step's sizing flags left unset take the GPU or the
    --cpu-smoke default."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Run unattended with: python benchmarks/gpu_kernels.py --out "
        "$OUT/gpu_kernels.json (see the module docstring for what is measured).")
    add = parser.add_argument
    add("--out", help="write the results as JSON to this path")
    add("--parts", default="step,kernels",
        help="comma-separated parts to run, of step and kernels (default: both)")
    add("--budget-s", type=float, default=270.0,
        help="no variant, step round or kernel pattern starts that would end (judged by the "
        "longest like it so far) after this many seconds (default 270, so that the defaults "
        "end within 5 minutes; 0: no limit)")
    add("--hbm-gbps", type=float, default=None,
        help="HBM bandwidth in GB/s, used when zeroc has no hardware profile of the device")
    add("--rows", type=int, default=8192, help="rows of the kernel patterns (default 8192)")
    add("--cols", type=int, default=4096, help="columns of the kernel patterns (default 4096)")
    for key, what in (("d_model", "model width"), ("n_layer", "transformer blocks"),
                      ("n_head", "attention heads"), ("seq", "sequence length (block size)"),
                      ("vocab", "vocabulary size"), ("batch", "sequences per step"),
                      ("steps", "timed interleaved steps per variant"),
                      ("warmup", "untimed rounds after the first (compiling) step")):
        add(f"--{key.replace('_', '-')}", type=int, default=None,
            help=f"step: {what} (default {gpu_step.GPU_SIZE[key]}; --cpu-smoke: "
            f"{gpu_step.SMOKE_SIZE[key]})")
    add("--dtype", choices=("bf16", "fp32"), default="bf16",
        help="step: the autocast dtype (bf16) or none (fp32) (default bf16)")
    add("--lr", type=float, default=3e-4, help="step: AdamW learning rate (default 3e-4)")
    add("--variants", default=None,
        help=f"step: comma-separated subset of {', '.join(gpu_step.VARIANTS)} (default: "
        f"{', '.join(gpu_step.GPU_VARIANTS)}; --cpu-smoke: {', '.join(gpu_step.CPU_VARIANTS)})")
    add("--cpu-smoke", action="store_true",
        help="run the step part tiny on the CPU (eager and zeroc), to test the script")
    add("--cpu-inductor", action="store_true",
        help="with --cpu-smoke, also run the Inductor variants (slow C++ compiles)")
    add("--cache-dir", default=None,
        help="zeroc kernel cache (default: a fresh temporary directory)")
    opts = parser.parse_args(argv)
    sizes = gpu_step.SMOKE_SIZE if opts.cpu_smoke else gpu_step.GPU_SIZE
    for key, value in sizes.items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
        if getattr(opts, key) < (0 if key == "warmup" else 1):
            parser.error(f"--{key.replace('_', '-')}={getattr(opts, key)} is too small")
    if opts.d_model % opts.n_head:
        parser.error(f"--d-model={opts.d_model} must be divisible by --n-head={opts.n_head}")
    opts.parts = [p.strip() for p in opts.parts.split(",") if p.strip()]
    if not opts.parts or set(opts.parts) - {"step", "kernels"}:
        parser.error(f"--parts={','.join(opts.parts)!r}: choose from step, kernels")
    if opts.variants is None:
        opts.variants = gpu_step.default_variants(opts.cpu_smoke, opts.cpu_inductor)
    else:
        opts.variants = [v.strip() for v in opts.variants.split(",") if v.strip()]
        unknown = [v for v in opts.variants if v not in gpu_step.VARIANTS]
        if unknown or not opts.variants:
            parser.error(f"--variants: {unknown} not known; choose from "
                         f"{', '.join(gpu_step.VARIANTS)}")
    return opts


def _write(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as handle:
            json.dump(payload, handle, indent=1)


def _versions() -> dict[str, Any]:
    try:
        import triton

        triton_version = triton.__version__
    except Exception as error:  # triton is optional for the CPU smoke run
        triton_version = f"not importable ({type(error).__name__})"
    return {"torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the process exit status."""
    opts = parse_args(argv)
    budget = gpu_step.Budget(opts.budget_s)
    if not torch.cuda.is_available() and not opts.cpu_smoke:
        reason = ("no CUDA device: this benchmark times the training step and Triton kernels "
                  "on a GPU; nothing to do (--cpu-smoke runs the step tiny on the CPU)")
        print(reason, file=sys.stderr)
        _write(opts.out, {"skipped": reason})
        return 0
    device = "cpu" if opts.cpu_smoke else "cuda"
    device_name = torch.cuda.get_device_name() if device == "cuda" else None
    opts.cache_dir = opts.cache_dir or tempfile.mkdtemp(prefix="zeroc_bench_")
    hbm = resolve_hbm(device_name, opts.hbm_gbps)
    payload: dict[str, Any] = {
        "meta": {"device": device_name or "cpu", "mode": "cpu-smoke" if opts.cpu_smoke else "gpu",
                 **_versions(), "budget_s": opts.budget_s, "parts": opts.parts},
        "hbm": hbm}
    print(f"gpu_kernels: {device_name or 'CPU smoke run'}, torch {torch.__version__}, HBM "
          f"{_fmt(hbm['bytes_per_s'], '.0f', 1e-9)} GB/s ({hbm['source']})", flush=True)
    ok = True
    if "step" in opts.parts:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[opts.dtype]
        cfg = gpu_step.GPTConfig(vocab_size=opts.vocab, block_size=opts.seq,
                                 n_layer=opts.n_layer, n_head=opts.n_head, d_model=opts.d_model)
        setup = gpu_step.StepSetup(cfg, opts.batch, opts.steps, opts.warmup, opts.lr, device,
                                   dtype, os.path.join(opts.cache_dir, "step"))
        step = gpu_step.run_step_comparison(setup, opts.variants, budget)
        payload["step"] = step
        print(f"\nTraining step ({step['parameters']} parameters, {step['tokens_per_step']} "
              f"tokens, {opts.dtype}, median of {opts.steps} interleaved steps):")
        print(gpu_step.format_step_table(step), flush=True)
        ok &= not step["loss_mismatch"] and all(
            s["ran"] or s["skipped"] for s in step["variants"].values())
        gc.collect()
        torch.compiler.reset()
        if device == "cuda":
            torch.cuda.empty_cache()
    if "kernels" in opts.parts:
        if device == "cuda":
            kernels = run_kernels(opts, hbm["bytes_per_s"], budget)
            print("\nKernels (do_bench medians; GB/s = (input + output bytes) / time):")
            print(format_table(kernels["results"]))
            ok &= all(r["zeroc_ok"] for r in kernels["results"])
        else:
            kernels = {"skipped": "the kernel patterns time Triton kernels on a CUDA device"}
        payload["kernels"] = kernels
    payload["meta"]["elapsed_s"] = budget.elapsed()
    payload["ok"] = bool(ok)
    _write(opts.out, payload)
    print(f"\ngpu_kernels: {'ok' if ok else 'NOT ok'} in {budget.elapsed():.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
