"""Benchmark zeroc's fused Triton kernels against eager aten and Inductor on one CUDA GPU.

For softmax (forward and backward), layer norm, RMS norm, GELU+bias and a cross-entropy style
log-softmax, at realistic sizes in fp32 and bf16, each pattern is traced to an aten graph,
run through zeroc's fusion pass with ``kernels="triton"`` (autotuned on first call), and
timed with ``triton.testing.do_bench`` next to eager PyTorch and
``torch.compile(backend="inductor")``. Results are checked against eager, printed as a table
of milliseconds and ratios, and written as JSON to ``--out``.

    python benchmarks/gpu_kernels.py --out results.json [--rows 8192 --cols 4096]

Without CUDA it prints why and exits with status 0 (writing ``{"skipped": ...}`` to --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import types

import torch
import torch.nn.functional as F

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


def bench_one(name: str, fn, args: tuple, dtype: torch.dtype, cache_dir: str) -> dict:
    """Time eager, Inductor and zeroc for one pattern; check zeroc and Inductor vs eager."""
    from triton.testing import do_bench

    zeroc_fn, n_kernels = zeroc_compile(fn, args, cache_dir)
    inductor_fn = torch.compile(fn, backend="inductor")
    ref = fn(*args)
    ok_z, err_z = _close(zeroc_fn(*args), ref, dtype)
    ok_i, err_i = _close(inductor_fn(*args), ref, dtype)
    times = {label: do_bench(lambda f=f: f(*args), warmup=25, rep=100)
             for label, f in (("eager", fn), ("inductor", inductor_fn), ("zeroc", zeroc_fn))}
    return {"pattern": name, "dtype": str(dtype).removeprefix("torch."),
            "shape": list(args[0].shape), "zeroc_kernels": n_kernels,
            "eager_ms": times["eager"], "inductor_ms": times["inductor"],
            "zeroc_ms": times["zeroc"],
            "zeroc_over_inductor": times["zeroc"] / times["inductor"],
            "zeroc_over_eager": times["zeroc"] / times["eager"],
            "zeroc_ok": ok_z, "zeroc_err": err_z, "inductor_ok": ok_i, "inductor_err": err_i}


def format_table(rows: list[dict]) -> str:
    """The results as a fixed-width text table."""
    head = (f"{'pattern':<16}{'dtype':<10}{'eager ms':>10}{'inductor ms':>13}{'zeroc ms':>10}"
            f"{'z/ind':>8}{'z/eager':>9}  match")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['pattern']:<16}{r['dtype']:<10}{r['eager_ms']:>10.3f}"
                     f"{r['inductor_ms']:>13.3f}{r['zeroc_ms']:>10.3f}"
                     f"{r['zeroc_over_inductor']:>8.2f}{r['zeroc_over_eager']:>9.2f}  "
                     f"{'yes' if r['zeroc_ok'] else 'NO'} ({r['zeroc_err']:.1e})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON to this path")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--cache-dir", default=None,
                        help="zeroc kernel cache (default: a fresh temporary directory)")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        reason = "no CUDA device: this benchmark times Triton kernels on a GPU; nothing to do"
        print(reason, file=sys.stderr)
        if opts.out:
            with open(opts.out, "w") as handle:
                json.dump({"skipped": reason}, handle)
        return 0
    cache_dir = opts.cache_dir or tempfile.mkdtemp(prefix="zeroc_bench_")
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (fn, args) in patterns(opts.rows, opts.cols, dtype, "cuda").items():
            fn.__name__ = name
            results.append(bench_one(name, fn, args, dtype, cache_dir))
            print(format_table(results[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_table(results))
    if opts.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "rows": opts.rows, "cols": opts.cols}
        with open(opts.out, "w") as handle:
            json.dump({"meta": meta, "results": results}, handle, indent=1)
    return 0 if all(r["zeroc_ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
