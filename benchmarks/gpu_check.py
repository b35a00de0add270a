"""Train the zoo GPT on one GPU: eager, Inductor, zeroc, and zeroc ZeRO-3 on a world-1 group.

The zoo GPT (default: width 768, 12 layers, 12 heads, sequence 1024, vocab 32768, batch 8, about
110M parameters) trains with AdamW in bf16 for a few steps in each of these configurations:

- ``eager``: plain PyTorch under ``torch.autocast(dtype=torch.bfloat16)``;
- ``inductor``: ``torch.compile(model)`` (the default backend) under the same autocast;
- ``zeroc``: ``torch.compile(model, backend="zeroc")`` without ``parallelize``, same autocast;
- ``zeroc_zero3``: ``zeroc.parallelize(model, zero=3,
  mixed_precision=zeroc.MixedPrecision(param_dtype=torch.bfloat16))`` on a world-1 NCCL process
  group (initialized once at the start on a free local TCP port), then
  ``torch.compile(model, backend="zeroc")`` (``--zero3-precision autocast`` runs it with fp32
  parameters under autocast instead).

Every model is built from the same seed (``GPT(cfg, seed=0)``) and trains on the same batches
(``--batches`` distinct random-token batches, cycled; with the default of 1 the model memorizes
one batch, so the loss falls step by step and a wrong gradient shows). A run of one
configuration is: build, the first step (timed on its own: it includes compilation),
``--warmup`` untimed steps, ``--steps`` timed steps. Each step's time is wall time around
forward, backward, ``optimizer.step()`` and ``zero_grad``, with ``torch.cuda.synchronize()``
before and after. ``--repeats`` runs the configurations interleaved (repeat r runs every
configuration once before repeat r + 1 starts), each in a fresh model after
``torch._dynamo.reset()``; each number reported is the median over the repeats of a repeat's
median step. Compiler caches start empty in a fresh temporary directory (``--cache-dir``), so
the first repeat's first step is a cold compile and the later ones are warm.

Reported per configuration: step time, tokens per second, step time over eager's and over
Inductor's (below 1 is faster), first-step time of each repeat, peak CUDA memory
(``torch.cuda.max_memory_allocated``, reset before each build) and MFU: model FLOPs per step /
step time / the device's peak dense bf16 FLOP/s. Model FLOPs per step are counted with
``torch.utils.flop_counter.FlopCounterMode`` over one eager forward + backward (attention is
counted as SDPA's full, non-causal matmuls; recomputation is not counted); the analytic
``6 * matmul parameters * tokens + 12 * layers * width * seq * tokens`` is reported beside it
and used if the counter fails. The peak comes from ``zeroc.runtime.hardware``
(``profile_for_device_name(torch.cuda.get_device_name())``, or ``--hardware NAME``); when that
module or the device's profile is missing, MFU is "unknown" and the reason is printed.

Losses: every step's loss of every configuration and repeat is compared with the loss of
eager's first repeat at the same step; they agree when ``|loss - eager| <= rtol * |eager| +
atol`` with rtol = atol = 2e-2 in bf16 (bf16 keeps 8 significant bits, a relative step of
about 4e-3, and bf16 matmuls, fused kernels and pure-bf16 parameters under MixedPrecision
round differently from autocast over a dozen optimizer steps) and rtol = 1e-3, atol = 1e-4 in
fp32 (summation order only).

A failing configuration (an exception) is recorded with its traceback in the JSON and the
others still run. The JSON (``--json``; default ``$OUT/gpu_check.json`` when the environment
variable OUT is set, else ``gpu_check.json``) holds the versions, the device, the hardware
profile, every repeat's step times, losses and errors, and ``ok``: every configuration ran in
every repeat that ran and its losses agree with eager's. The exit status is 0 when ``ok``, 1
when not, 2 when there is no CUDA device (without ``--cpu-smoke``). The defaults are sized to
end within 5 minutes on an H200 (the cold compiles of the first repeat take most of it): no
repeat after the first starts once ``--time-budget-s`` (180 s) have passed, and the repeats
left out are reported.

    python benchmarks/gpu_check.py --json $OUT/gpu_check.json

``--cpu-smoke`` runs the same code tiny (width 32, 2 layers, sequence 16, 2 steps, 1 repeat)
on the CPU in fp32, with a gloo group in place of NCCL, to check the script itself:

    python benchmarks/gpu_check.py --cpu-smoke --json /tmp/gpu_check.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from models.gpt import GPT, GPTConfig, random_token_batch  # noqa: E402

CONFIGS = ("eager", "inductor", "zeroc", "zeroc_zero3")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# dtype -> (rtol, atol) of the loss comparison with eager.
TOLERANCE = {torch.bfloat16: (2e-2, 2e-2), torch.float32: (1e-3, 1e-4)}
# Defaults of the sizing flags: on the GPU, and under --cpu-smoke.
GPU_DEFAULTS = {"d_model": 768, "n_layer": 12, "n_head": 12, "seq": 1024, "vocab": 32768,
                "batch": 8, "steps": 10, "warmup": 3, "repeats": 3, "dtype": "bf16"}
SMOKE_DEFAULTS = {"d_model": 32, "n_layer": 2, "n_head": 2, "seq": 16, "vocab": 64,
                  "batch": 4, "steps": 2, "warmup": 0, "repeats": 1, "dtype": "fp32"}
NO_CUDA_EXIT = 2


@dataclass(frozen=True)
class Setup:
    """What every configuration trains, and how."""

    model: GPTConfig
    batch: int
    steps: int
    warmup: int
    lr: float
    device: str
    dtype: torch.dtype
    zero3_precision: str
    cache_dir: str


@dataclass
class Run:
    """One repeat of one configuration; times in seconds, ``None`` where it did not get there."""

    config: str
    repeat: int
    first_step_s: float | None = None
    step_s: list[float] = field(default_factory=list)
    step_median_s: float | None = None
    losses: list[float] = field(default_factory=list)
    peak_memory_bytes: int | None = None
    wall_s: float | None = None
    error: str | None = None
    traceback: str | None = None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options; sizing flags left unset take the GPU or the --cpu-smoke default."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Sizing flags default to the GPU values; under --cpu-smoke to "
        + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in SMOKE_DEFAULTS.items())
        + ". Run with --json $OUT/gpu_check.json; see the module docstring for what is measured.")
    add = parser.add_argument

    def sized(name: str, kind: type, what: str) -> None:
        key = name.replace("-", "_")
        add(f"--{name}", type=kind, default=None,
            help=f"{what} (default {GPU_DEFAULTS[key]}; --cpu-smoke: {SMOKE_DEFAULTS[key]})")

    sized("d-model", int, "model width")
    sized("n-layer", int, "transformer blocks")
    sized("n-head", int, "attention heads")
    sized("seq", int, "sequence length (also the model's block size)")
    sized("vocab", int, "vocabulary size")
    sized("batch", int, "sequences per step")
    sized("steps", int, "timed steps per configuration and repeat")
    sized("warmup", int, "untimed steps after the first step (which compiles) and before the "
          "timed ones")
    sized("repeats", int, "interleaved repeats of every configuration; the median is reported")
    add("--dtype", choices=sorted(DTYPES), default=None,
        help="compute dtype: bf16 runs eager, inductor and zeroc under torch.autocast and "
        f"zeroc_zero3 per --zero3-precision (default {GPU_DEFAULTS['dtype']}; --cpu-smoke: "
        f"{SMOKE_DEFAULTS['dtype']})")
    add("--zero3-precision", choices=("mixed", "autocast"), default="mixed",
        help="how zeroc_zero3 computes in bf16: 'mixed' passes "
        "zeroc.MixedPrecision(param_dtype=torch.bfloat16) to parallelize (bf16 parameters, "
        "fp32 shards as the optimizer's master copy); 'autocast' keeps fp32 parameters and "
        "runs under torch.autocast like the others (default: mixed)")
    add("--configs", default=",".join(CONFIGS),
        help=f"comma-separated subset of {', '.join(CONFIGS)}; eager is always run, as the "
        "reference of the losses (default: all)")
    add("--batches", type=int, default=1,
        help="distinct random-token batches cycled over the steps (default 1: one batch, "
        "memorized, so the loss falls)")
    add("--lr", type=float, default=3e-4, help="AdamW learning rate (default 3e-4)")
    add("--hardware", metavar="NAME", default=None,
        help="hardware profile for the peak FLOP/s of the MFU, a name zeroc.runtime.hardware."
        "get_profile knows (e.g. h200, h100-sxm, a100-80gb); default: looked up from "
        "torch.cuda.get_device_name()")
    add("--time-budget-s", type=float, default=180.0,
        help="no repeat after the first starts once this many seconds have passed since the "
        "start; the repeats left out are reported (default 180, so that the defaults end "
        "within 5 minutes; 0: no limit)")
    add("--cache-dir", default=None,
        help="directory for the Inductor and zeroc caches (default: a fresh temporary "
        "directory, so the first compile of each backend is cold)")
    add("--json", metavar="PATH", default=None,
        help="where to write the results as JSON (default $OUT/gpu_check.json when the "
        "environment variable OUT is set, else gpu_check.json)")
    add("--cpu-smoke", action="store_true",
        help="run the same code tiny on the CPU in fp32 with a gloo group in place of NCCL, "
        "to test the script without a GPU")
    args = parser.parse_args(argv)
    defaults = SMOKE_DEFAULTS if args.cpu_smoke else GPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("d_model", "n_layer", "n_head", "seq", "vocab", "batch", "steps", "repeats",
                "batches"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')}={getattr(args, key)} must be >= 1")
    if args.time_budget_s < 0:
        parser.error(f"--time-budget-s={args.time_budget_s} must be >= 0")
    if args.warmup < 0:
        parser.error(f"--warmup={args.warmup} must be >= 0")
    if args.d_model % args.n_head:
        parser.error(f"--d-model={args.d_model} must be divisible by --n-head={args.n_head}")
    if not args.lr > 0:
        parser.error(f"--lr={args.lr} must be > 0")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs={args.configs!r}: {unknown} not known; allowed: {list(CONFIGS)}")
    args.configs = [c for c in CONFIGS if c == "eager" or c in configs]
    args.json_explicit = args.json is not None or bool(os.environ.get("OUT"))
    if args.json is None:
        out = os.environ.get("OUT")
        args.json = os.path.join(out, "gpu_check.json") if out else "gpu_check.json"
    return args


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_world_one(backend: str) -> str:
    """Initialize a world-1 process group (rank 0) on a free local port; return its address."""
    address = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group(backend, rank=0, world_size=1, init_method=address)
    return address


def resolve_peak(hardware: str | None, device_name: str | None, dtype: torch.dtype
                 ) -> dict[str, Any]:
    """The peak dense FLOP/s for ``dtype`` and the profile it comes from, or why there is none.

    Returns ``{"name", "peak_flops", "memory_bytes_per_s", "source", "reason"}``; ``peak_flops``
    is ``None`` (and ``reason`` says why) when ``zeroc.runtime.hardware`` cannot be imported,
    ``hardware`` is not a known profile, or ``device_name`` matches none. Never raises.
    """
    found: dict[str, Any] = {"name": None, "peak_flops": None, "memory_bytes_per_s": None,
                             "source": None, "reason": None}
    try:
        from zeroc.runtime.hardware import get_profile, profile_for_device_name
    except Exception as error:  # the module is optional here: MFU is then unknown
        found["reason"] = f"zeroc.runtime.hardware is not available ({type(error).__name__}: " \
                          f"{error})"
        return found
    try:
        if hardware is not None:
            profile = get_profile(hardware)
        elif device_name is None:
            found["reason"] = "no CUDA device name to look a profile up by; pass --hardware NAME"
            return found
        else:
            profile = profile_for_device_name(device_name)
            if profile is None:
                found["reason"] = (f"no known hardware profile matches the device "
                                   f"{device_name!r}; pass --hardware NAME")
                return found
        found.update(name=profile.name, peak_flops=float(profile.flops_for(dtype)),
                     memory_bytes_per_s=float(profile.memory_bytes_per_s),
                     source=getattr(profile, "source", None))
    except Exception as error:  # a bad --hardware name or a profile without the figure
        found["reason"] = f"no peak FLOP/s from the hardware profile ({type(error).__name__}: " \
                          f"{error})"
    return found


def amp_context(setup: Setup, config: str) -> contextlib.AbstractContextManager:
    """The autocast region the configuration's forward runs in (none in fp32 or with
    zeroc's MixedPrecision)."""
    if setup.dtype == torch.float32:
        return contextlib.nullcontext()
    if config == "zeroc_zero3" and setup.zero3_precision == "mixed":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(setup.device).type, dtype=setup.dtype)


def analytic_flops(cfg: GPTConfig, batch: int) -> int:
    """``6 * matmul parameters * tokens`` (the tied head counted once, as the head) plus
    ``12 * layers * width * seq * tokens`` (attention scores and values, forward and backward,
    without the causal half skipped)."""
    width, layers = cfg.d_model, cfg.n_layer
    per_block = width * 3 * width + width * width + width * 4 * width * 2
    matmul_params = layers * per_block + width * cfg.vocab_size
    tokens = batch * cfg.block_size
    return 6 * matmul_params * tokens + 12 * layers * width * cfg.block_size * tokens


def count_flops(setup: Setup, tokens: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """FLOPs of one eager forward + backward counted by ``FlopCounterMode``; never raises."""
    from torch.utils.flop_counter import FlopCounterMode

    result: dict[str, Any] = {"counted": None, "by_op": {}, "error": None}
    model = None
    try:
        model = GPT(setup.model, seed=0).to(setup.device)
        counter = FlopCounterMode(display=False)
        with counter:
            with amp_context(setup, "eager"):
                loss = model(tokens, targets)
            loss.backward()
        result["counted"] = int(counter.get_total_flops())
        totals: dict[str, int] = {}
        for ops in counter.get_flop_counts().values():
            for op, flops in ops.items():
                totals[str(op)] = max(totals.get(str(op), 0), int(flops))
        result["by_op"] = dict(sorted(totals.items(), key=lambda kv: -kv[1]))
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
        print(f"FlopCounterMode failed, MFU uses the analytic count:\n{traceback.format_exc()}",
              file=sys.stderr)
    del model
    release_memory(setup.device)
    return result


def release_memory(device: str) -> None:
    """Drop compiled code and free cached device memory between configurations."""
    torch._dynamo.reset()
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def synchronize(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build(config: str, setup: Setup) -> tuple[torch.nn.Module, Any]:
    """A fresh model from seed 0 on the device and the callable configuration ``config`` runs."""
    model = GPT(setup.model, seed=0).to(setup.device)
    zeroc_options = {"cache_dir": os.path.join(setup.cache_dir, "zeroc")}
    if config == "eager":
        return model, model
    if config == "inductor":
        return model, torch.compile(model)
    if config == "zeroc":
        return model, torch.compile(model, backend="zeroc", options=zeroc_options)
    if config == "zeroc_zero3":
        import zeroc

        if not dist.is_initialized():
            raise RuntimeError("zeroc_zero3 needs the world-1 process group, which did not "
                               "initialize (see the error at the start)")
        policy = None
        if setup.dtype != torch.float32 and setup.zero3_precision == "mixed":
            policy = zeroc.MixedPrecision(param_dtype=setup.dtype)
        zeroc.parallelize(model, zero=3, mixed_precision=policy)
        return model, torch.compile(model, backend="zeroc", options=zeroc_options)
    raise ValueError(f"configuration {config!r} is not known; known: {list(CONFIGS)}")


def run_config(config: str, repeat: int, setup: Setup,
               batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Run:
    """Build and train configuration ``config`` once; an exception is recorded, not raised."""
    result = Run(config, repeat)
    begin = time.perf_counter()
    model = run = optimizer = None
    cuda = setup.device.startswith("cuda")
    try:
        release_memory(setup.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        model, run = build(config, setup)
        optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr)
        for step in range(1 + setup.warmup + setup.steps):
            tokens, targets = batches[step % len(batches)]
            synchronize(setup.device)
            start = time.perf_counter()
            with amp_context(setup, config):
                loss = run(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(setup.device)
            elapsed = time.perf_counter() - start
            result.losses.append(float(loss.detach().float()))
            if step == 0:
                result.first_step_s = elapsed
            elif step > setup.warmup:
                result.step_s.append(elapsed)
        result.step_median_s = statistics.median(result.step_s)
        if cuda:
            result.peak_memory_bytes = int(torch.cuda.max_memory_allocated())
    except Exception as error:  # a failing configuration is reported, the others still run
        first_line = str(error).splitlines()[0] if str(error) else ""
        result.error = f"{type(error).__name__}: {first_line}"
        result.traceback = traceback.format_exc()
        print(f"[repeat {repeat + 1}] {config} failed:\n{result.traceback}", file=sys.stderr,
              flush=True)
    finally:
        del model, run, optimizer
        with contextlib.suppress(Exception):
            release_memory(setup.device)
    result.wall_s = time.perf_counter() - begin
    return result


def compare_losses(losses: list[float], reference: list[float] | None, dtype: torch.dtype
                   ) -> dict[str, Any]:
    """Step-by-step agreement of ``losses`` with ``reference`` within ``TOLERANCE[dtype]``."""
    rtol, atol = TOLERANCE[dtype]
    if reference is None:
        return {"agree": False, "max_abs_diff": None, "max_rel_diff": None,
                "reason": "no eager losses to compare with (eager failed)"}
    if len(losses) != len(reference):
        return {"agree": False, "max_abs_diff": None, "max_rel_diff": None,
                "reason": f"{len(losses)} losses against eager's {len(reference)}"}
    diffs = [abs(a - b) for a, b in zip(losses, reference, strict=True)]
    agree = all(d <= rtol * abs(b) + atol for d, b in zip(diffs, reference, strict=True))
    finite = all(math.isfinite(v) for v in losses)
    rel = [d / max(abs(b), 1e-12) for d, b in zip(diffs, reference, strict=True)]
    return {"agree": bool(agree and finite), "max_abs_diff": max(diffs), "max_rel_diff": max(rel),
            "reason": None if agree and finite else "outside the tolerance or not finite"}


def median_or_none(values: list[float | None]) -> float | None:
    """The median of the values that are not ``None``, or ``None``."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(runs: dict[str, list[Run]], setup: Setup, flops: float | None,
              peak: float | None) -> dict[str, dict[str, Any]]:
    """Per configuration: medians over the repeats, ratios, MFU and the loss comparison."""
    eager_ok = [r for r in runs["eager"] if r.error is None]
    reference = eager_ok[0].losses if eager_ok else None
    tokens = setup.batch * setup.model.block_size
    summaries: dict[str, dict[str, Any]] = {}
    for config, repeats in runs.items():
        step = median_or_none([r.step_median_s for r in repeats])
        comparisons = [compare_losses(r.losses, reference, setup.dtype)
                       for r in repeats if r.error is None]
        peak_mem = median_or_none([r.peak_memory_bytes for r in repeats])
        summaries[config] = {
            "step_median_s": step,
            "step_median_s_per_repeat": [r.step_median_s for r in repeats],
            "tokens_per_s": tokens / step if step else None,
            "first_step_s_per_repeat": [r.first_step_s for r in repeats],
            "peak_memory_bytes": None if peak_mem is None else int(peak_mem),
            "peak_memory_bytes_per_repeat": [r.peak_memory_bytes for r in repeats],
            "achieved_flops_per_s": flops / step if flops and step else None,
            "mfu": flops / step / peak if flops and step and peak else None,
            "final_loss": repeats[-1].losses[-1] if repeats[-1].losses else None,
            "loss_comparison": comparisons,
            "losses_agree": bool(comparisons) and len(comparisons) == len(repeats)
            and all(c["agree"] for c in comparisons),
            "ran": all(r.error is None for r in repeats),
            "errors": [r.error for r in repeats if r.error],
        }
    for summary in summaries.values():
        for baseline in ("eager", "inductor"):
            theirs = summaries.get(baseline, {}).get("step_median_s")
            ours = summary["step_median_s"]
            summary[f"time_over_{baseline}"] = ours / theirs if ours and theirs else None
    return summaries


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    """``value * scale`` formatted with ``spec``, or n/a."""
    return "n/a" if value is None else format(value * scale, spec)


def report(summaries: dict[str, dict[str, Any]], mfu_reason: str | None) -> str:
    """The results as a text table."""
    rows = []
    for config, s in summaries.items():
        comparisons = s["loss_comparison"]
        worst = max((c["max_rel_diff"] for c in comparisons if c["max_rel_diff"] is not None),
                    default=None)
        agree = "yes" if s["losses_agree"] else "NO"
        if s["mfu"] is None:
            mfu = "unknown" if mfu_reason else "n/a"
        else:  # a tiny model on the CPU gets a tiny MFU: keep two digits of it
            mfu = f"{s['mfu']:.1%}" if s["mfu"] >= 1e-3 else f"{s['mfu'] * 100:.2g}%"
        rows.append([
            config, fmt(s["step_median_s"], ".2f", 1000),
            " / ".join(fmt(v, ".2f", 1000) for v in s["step_median_s_per_repeat"]),
            fmt(s["tokens_per_s"], ",.0f"), fmt(s["time_over_eager"], ".2f"),
            fmt(s["time_over_inductor"], ".2f"),
            " / ".join(fmt(v, ".1f") for v in s["first_step_s_per_repeat"]),
            fmt(s["peak_memory_bytes"], ",.0f", 2.0**-20), mfu,
            f"{agree} ({fmt(worst, '.1e')})", "; ".join(s["errors"])])
    return tabulate(rows, disable_numparse=True, headers=[
        "config", "step ms", "per repeat", "tokens/s", "/eager", "/inductor",
        "first step s", "peak MiB", "MFU", "losses agree (max rel)", "error"])


def versions() -> dict[str, Any]:
    """Versions of Python, torch, CUDA and Triton."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception as error:  # Triton is optional on the CPU
        triton_version = f"not importable ({type(error).__name__})"
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton_version}


def device_details(device: str) -> dict[str, Any]:
    """Compute capability, memory and multiprocessors of the CUDA device (empty on the CPU)."""
    if not device.startswith("cuda"):
        return {}
    props = torch.cuda.get_device_properties(device)
    return {"device_capability": f"{props.major}.{props.minor}",
            "device_memory_bytes": int(props.total_memory),
            "device_multiprocessors": int(props.multi_processor_count)}


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` (its directory is created)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=1)


def main(argv: list[str] | None = None) -> int:
    """Run every configuration, print the table, write the JSON; return the exit status."""
    args = parse_args(argv)
    try:
        return check(args)
    except Exception as error:  # outside any one configuration: still leave a record
        trace = traceback.format_exc()
        print(f"gpu_check failed:\n{trace}", file=sys.stderr)
        write_json(args.json, {"ok": False, "error": f"{type(error).__name__}: {error}",
                               "traceback": trace, **versions()})
        print(f"wrote {args.json}")
        return 1


def check(args: argparse.Namespace) -> int:
    """``main`` after the arguments are parsed."""
    if not args.cpu_smoke and not torch.cuda.is_available():
        reason = (f"no CUDA device is available (torch {torch.__version__}, CUDA build "
                  f"{torch.version.cuda}); this check trains on a GPU. Use --cpu-smoke to run "
                  "it tiny on the CPU.")
        print(f"gpu_check: {reason}", file=sys.stderr)
        if args.json_explicit:
            write_json(args.json, {"ok": False, "skipped": reason, **versions()})
        return NO_CUDA_EXIT
    begin = time.perf_counter()
    device = "cpu" if args.cpu_smoke else "cuda:0"
    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    else:  # tiny ops on a shared machine: OpenMP threads would wait on each other
        torch.set_num_threads(1)
    dtype = DTYPES[args.dtype]
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="zeroc-gpu-check-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer,
                    n_head=args.n_head, d_model=args.d_model)
    setup = Setup(cfg, args.batch, args.steps, args.warmup, args.lr, device, dtype,
                  args.zero3_precision, cache_dir)
    device_name = torch.cuda.get_device_name(0) if device.startswith("cuda") else None
    n_params = sum(p.numel() for p in GPT(cfg, seed=0).parameters())
    info = versions()
    print(f"gpu_check: {'CPU smoke run' if args.cpu_smoke else device_name}, torch "
          f"{info['torch']}, CUDA {info['cuda']}, triton {info['triton']}", flush=True)
    print(f"GPT {cfg} ({n_params / 1e6:.2f}M parameters), batch {args.batch}x{args.seq}, "
          f"{args.dtype}, AdamW lr {args.lr}, first step + {args.warmup} warm-up + "
          f"{args.steps} timed steps, {args.repeats} interleaved repeats, configurations "
          f"{', '.join(args.configs)}, caches in {cache_dir}", flush=True)

    batches = [tuple(t.to(device) for t in random_token_batch(
        cfg.vocab_size, cfg.block_size, args.batch, None, seed=1 + i))
        for i in range(args.batches)]
    group: dict[str, Any] = {"backend": None, "address": None, "error": None}
    if "zeroc_zero3" in args.configs:
        group["backend"] = "gloo" if args.cpu_smoke else "nccl"
        try:
            group["address"] = init_world_one(group["backend"])
            print(f"process group: {group['backend']}, world 1, {group['address']}", flush=True)
        except Exception as error:  # zeroc_zero3 then fails alone, with this reason
            group["error"] = f"{type(error).__name__}: {error}"
            print(f"process group failed to initialize:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)

    flop_count = count_flops(setup, *batches[0])
    analytic = analytic_flops(cfg, args.batch)
    flops = flop_count["counted"] or analytic
    basis = ("FlopCounterMode over one eager forward + backward" if flop_count["counted"]
             else "analytic 6 * matmul params * tokens + attention")
    if flop_count["counted"] and not any("attention" in op for op in flop_count["by_op"]):
        basis += ", without attention (no counter formula for the SDPA kernel that ran)"
    hardware = resolve_peak(args.hardware, device_name, dtype)
    print(f"model FLOPs per step: {flops / 1e12:.4g} TFLOP ({basis}); analytic "
          f"{analytic / 1e12:.4g} TFLOP", flush=True)
    if hardware["peak_flops"] is not None:
        print(f"peak {args.dtype}: {hardware['peak_flops'] / 1e12:.1f} TFLOP/s (hardware profile "
              f"{hardware['name']})", flush=True)
    else:
        print(f"MFU: unknown, {hardware['reason']}", flush=True)

    runs: dict[str, list[Run]] = {c: [] for c in args.configs}
    skipped_repeats = 0
    for repeat in range(args.repeats):
        elapsed = time.perf_counter() - begin
        if repeat and args.time_budget_s and elapsed > args.time_budget_s:
            skipped_repeats = args.repeats - repeat
            print(f"leaving out the last {skipped_repeats} repeat(s): {elapsed:.0f} s have "
                  f"passed, over --time-budget-s={args.time_budget_s:g}", flush=True)
            break
        for config in args.configs:
            result = run_config(config, repeat, setup, batches)
            runs[config].append(result)
            mem = fmt(result.peak_memory_bytes, ",.0f", 2.0**-20)
            last = result.losses[-1] if result.losses else None
            status = f"FAILED: {result.error}" if result.error else "ok"
            print(f"[repeat {repeat + 1}/{args.repeats}] {config}: first step "
                  f"{fmt(result.first_step_s, '.2f')} s, step median "
                  f"{fmt(result.step_median_s, '.2f', 1000)} ms, peak {mem} MiB, last loss "
                  f"{fmt(last, '.4f')}, wall {fmt(result.wall_s, '.1f')} s, {status}",
                  flush=True)
    repeats_run = args.repeats - skipped_repeats

    summaries = summarize(runs, setup, flops, hardware["peak_flops"])
    ok = all(s["ran"] and s["losses_agree"] for s in summaries.values())
    rtol, atol = TOLERANCE[dtype]
    print(f"\nMedians over {repeats_run} repeat(s); step time ratios below 1 are faster; MFU "
          f"against {fmt(hardware['peak_flops'], '.1f', 1e-12)} TFLOP/s; losses agree when "
          f"|loss - eager| <= {rtol:g} * |eager| + {atol:g} at every step")
    print(report(summaries, hardware["reason"]))
    if hardware["peak_flops"] is None:
        print(f"MFU unknown: {hardware['reason']}")
    eager_losses = runs["eager"][0].losses
    if eager_losses:
        print(f"eager loss: first {eager_losses[0]:.4f}, last {eager_losses[-1]:.4f}")
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    wall = time.perf_counter() - begin
    print(f"{'ok' if ok else 'NOT ok'}: {sum(s['ran'] for s in summaries.values())} of "
          f"{len(summaries)} configurations ran in every repeat, losses "
          f"{'agree' if all(s['losses_agree'] for s in summaries.values()) else 'DIFFER'}; "
          f"{wall:.1f} s in all")

    payload = {
        "ok": ok,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        **info,
        "device": device_name or "cpu", **device_details(device),
        "hostname": platform.node(),
        "hardware": hardware,
        "model": asdict(cfg), "parameters": n_params, "batch": args.batch, "seq": args.seq,
        "tokens_per_step": args.batch * args.seq, "batches": args.batches,
        "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
        "repeats_run": repeats_run, "time_budget_s": args.time_budget_s,
        "dtype": args.dtype, "zero3_precision": args.zero3_precision, "lr": args.lr,
        "configs": args.configs, "process_group": group, "cache_dir": cache_dir,
        "loss_tolerance": {"rtol": rtol, "atol": atol,
                           "rule": "|loss - eager| <= rtol * |eager| + atol at every step, "
                                   "against eager's first repeat"},
        "flops_per_step": {"used": flops, "basis": basis, "counted": flop_count["counted"],
                           "analytic": analytic, "counted_by_op": flop_count["by_op"],
                           "counter_error": flop_count["error"]},
        "results": summaries,
        "runs": {c: [asdict(r) for r in rs] for c, rs in runs.items()},
        "wall_s": wall,
    }
    write_json(args.json, payload)
    print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
