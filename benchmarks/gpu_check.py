"""What one GPU can check unattended, in under 13 minutes, written to one JSON file.

    python benchmarks/gpu_check.py --out $OUT

runs eight sections (``benchmarks/gpu_checks/``) on the zoo GPT of ``tests/models`` (default:
width 768, 12 layers, 12 heads, sequence 1024, vocabulary 32768, batch 8: about 110M
parameters, bf16):

- ``train``: the training step as eager, Inductor and zeroc: step-time medians over
  interleaved rounds, ratios to eager and Inductor, tokens/s, MFU (FLOPs per step by
  ``FlopCounterMode``, the peak bf16 FLOP/s of zeroc's hardware profile of the device), and
  every step's loss against eager's;
- ``kernels``: zeroc's Triton kernels against Inductor's (and eager) on the same fused groups
  (``benchmarks/gpu_kernels.py``);
- ``fused_loss``: ``zeroc::linear_cross_entropy`` against eager ``F.cross_entropy(lm_head(h))``:
  time, peak memory, largest absolute differences of the loss and gradients;
- ``zero3``: ``zeroc.parallelize(model, zero=3)`` on a world-1 NCCL group: losses against
  eager's, step times;
- ``memory``: ``torch.cuda.max_memory_allocated`` of the zeroc step against the plan's per-rank
  peak (``zeroc.explain``);
- ``syncs``: host synchronizations per steady step (``torch.cuda.set_sync_debug_mode("warn")``
  over steps 3-5) of eager, zeroc and zeroc ZeRO-3;
- ``collectives``: zeroc's collective paths on the one device. At world 1 ZeRO-3 issues no
  collective (a group of one rank only reshapes) and NCCL refuses two ranks on one GPU, so
  the check keeps zeroc's collectives on the world-1 NCCL group (a switch of the check only,
  ``gpu_checks.paths.kept_collectives``): ZeRO-3, quantized collectives (``gather_quant`` and
  ``reduce_quant`` int8) and optimizer offload, each against eager's losses, with the
  collectives each compiled and its host syncs;
- ``pipeline``: a pp = 2 DualPipeV pipeline's compiled stage programs on the one device, its
  two positions in turn in a child process as ranks of a world-2 ``fake`` group (transfers
  move no data, so values are not checked): every step runs, and the host waits for the
  device only where README says a pipelined call does.

Each section has a budget (``gpu_checks.SECTIONS``, 690 s in all; ``--time-budget-s`` is the
overall one); a section starts only while enough of the overall budget is left, else it is
skipped with the reason. A section that raises is recorded (type, message, traceback) and the
others still run. The JSON (``--out DIR`` writes ``DIR/gpu_check.json``; ``--json PATH`` a path
of its own; default ``$OUT/gpu_check.json`` when OUT is set, else ``./gpu_check.json``) holds
the environment (torch, CUDA, Triton, NCCL versions, the GPU), the settings, and per section
its ``status`` (``ok``, ``check_failed``, ``error``, ``skipped``), reason, error, budget, wall
time and figures. Exit status 0 when no section raised or failed its check, else 1. Without a
CUDA device every section is skipped for that reason, the JSON says so, and the exit status
is 0. ``--cpu-smoke`` runs the sections that can run on a CPU tiny, in fp32 with a gloo group
(the pipeline's fake group on the CPU), to check the script itself:

    python benchmarks/gpu_check.py --cpu-smoke --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_checks  # noqa: E402 -- needs the path above
from gpu_checks import flops, train  # noqa: E402
from gpu_checks.runner import (  # noqa: E402
    Budget,
    error_record,
    overall_status,
    run_sections,
    write_json,
)

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GPU_DEFAULTS = {"d_model": 768, "n_layer": 12, "n_head": 12, "seq": 1024, "vocab": 32768,
                "batch": 8, "steps": 20, "warmup": 3, "probe_steps": 10, "dtype": "bf16"}
SMOKE_DEFAULTS = {"d_model": 32, "n_layer": 2, "n_head": 2, "seq": 16, "vocab": 64,
                  "batch": 4, "steps": 2, "warmup": 1, "probe_steps": 7, "dtype": "fp32"}
JSON_NAME = "gpu_check.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options; sizing flags left unset take the GPU or the --cpu-smoke default."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Run unattended with: python benchmarks/gpu_check.py --out $OUT (writes "
        f"$OUT/{JSON_NAME}; see the module docstring for what is measured).")
    add = parser.add_argument
    add("--out", metavar="DIR", default=None, help=f"directory to write {JSON_NAME} in")
    add("--json", metavar="PATH", default=None,
        help=f"the JSON file to write (default DIR/{JSON_NAME} with --out, else "
        f"$OUT/{JSON_NAME} when OUT is set, else ./{JSON_NAME})")
    add("--sections", default=",".join(gpu_checks.SECTION_NAMES),
        help=f"comma-separated subset of {', '.join(gpu_checks.SECTION_NAMES)} (default: all)")
    add("--time-budget-s", type=float, default=gpu_checks.TOTAL_BUDGET_S,
        help="overall budget: a section starts only while the least time it needs is left "
        f"(default {gpu_checks.TOTAL_BUDGET_S:g}; 0: no limit, for the sections too)")

    def sized(name: str, kind: type, what: str) -> None:
        key = name.replace("-", "_")
        add(f"--{name}", type=kind, default=None,
            help=f"{what} (default {GPU_DEFAULTS[key]}; --cpu-smoke: {SMOKE_DEFAULTS[key]})")

    sized("d-model", int, "model width")
    sized("n-layer", int, "transformer blocks")
    sized("n-head", int, "attention heads")
    sized("seq", int, "sequence length (the model's block size)")
    sized("vocab", int, "vocabulary size")
    sized("batch", int, "sequences per step")
    sized("steps", int, "train: timed interleaved rounds")
    sized("warmup", int, "train: untimed rounds after each variant's first (compiling) step")
    sized("probe-steps", int, "zero3/memory/syncs/collectives/pipeline: steps of each probe "
          "run (syncs are counted on steps 3-5)")
    add("--dtype", choices=sorted(DTYPES), default=None,
        help=f"compute dtype: bf16 autocast, or fp32 (default {GPU_DEFAULTS['dtype']}; "
        f"--cpu-smoke: {SMOKE_DEFAULTS['dtype']})")
    add("--lr", type=float, default=3e-4, help="AdamW learning rate (default 3e-4)")
    add("--configs", default=None,
        help=f"train: comma-separated subset of {', '.join(train.VARIANTS)}; eager always "
        f"runs (default {','.join(train.GPU_DEFAULT)}; --cpu-smoke: "
        f"{','.join(train.CPU_DEFAULT)})")
    add("--zero3-precision", choices=("mixed", "autocast"), default="mixed",
        help="zero3 in bf16: 'mixed' passes zeroc.MixedPrecision(param_dtype=torch.bfloat16) "
        "to parallelize; 'autocast' keeps fp32 parameters under torch.autocast (default mixed)")
    add("--kernel-rows", type=int, default=8192, help="kernels: rows (default 8192)")
    add("--kernel-cols", type=int, default=4096, help="kernels: columns (default 4096)")
    add("--hardware", metavar="NAME", default=None,
        help="hardware profile for the MFU's peak FLOP/s, a name zeroc.runtime.cost.hardware."
        "get_profile knows (e.g. h200, h100-sxm, a100-80gb); default: looked up from "
        "torch.cuda.get_device_name()")
    add("--peak-tflops", type=float, default=None,
        help="the peak dense TFLOP/s of the compute dtype, in place of the hardware profile's")
    add("--cache-dir", default=None,
        help="directory for the Inductor and zeroc caches and the world-1 store (default: a "
        "fresh temporary directory, so the first compiles are cold)")
    add("--cpu-smoke", action="store_true",
        help="run the sections a CPU can run tiny in fp32, with a gloo group in place of NCCL")
    args = parser.parse_args(argv)
    for key, value in (SMOKE_DEFAULTS if args.cpu_smoke else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("d_model", "n_layer", "n_head", "seq", "vocab", "batch", "steps",
                "probe_steps", "kernel_rows", "kernel_cols"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')}={getattr(args, key)} must be >= 1")
    if args.warmup < 0 or args.time_budget_s < 0 or not args.lr > 0:
        parser.error("--warmup and --time-budget-s must be >= 0 and --lr > 0")
    if args.d_model % args.n_head:
        parser.error(f"--d-model={args.d_model} must be divisible by --n-head={args.n_head}")
    args.sections = _subset(parser, "--sections", args.sections, gpu_checks.SECTION_NAMES)
    default = train.CPU_DEFAULT if args.cpu_smoke else train.GPU_DEFAULT
    configs = _subset(parser, "--configs", args.configs or ",".join(default), train.VARIANTS)
    args.configs = ["eager", *(c for c in configs if c != "eager")]
    if args.json is None:
        out = args.out or os.environ.get("OUT") or "."
        args.json = os.path.join(out, JSON_NAME)
    return args


def _subset(parser: argparse.ArgumentParser, flag: str, text: str, allowed: tuple[str, ...]
            ) -> list[str]:
    chosen = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in allowed]
    if unknown or not chosen:
        parser.error(f"{flag}={text!r}: {unknown} not known; allowed: {', '.join(allowed)}")
    return chosen


def environment(cuda: bool) -> dict[str, Any]:
    """Versions (Python, torch, CUDA, Triton, NCCL) and the device."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception as error:  # Triton is optional on the CPU
        triton_version = f"not importable ({type(error).__name__})"
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "triton": triton_version,
                           "hostname": platform.node(), "device": "cpu"}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        env.update(device=torch.cuda.get_device_name(0),
                   device_capability=f"{props.major}.{props.minor}",
                   device_memory_bytes=int(props.total_memory),
                   device_multiprocessors=int(props.multi_processor_count))
        try:
            version = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) \
                else str(version)
        except Exception as error:  # recorded, not needed
            env["nccl"] = f"unknown ({type(error).__name__})"
    return env


def check(args: argparse.Namespace) -> dict[str, Any]:
    """Run the selected sections; return the JSON payload."""
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if cuda:
        torch.cuda.set_device(0)
    elif args.cpu_smoke:  # tiny ops on a shared machine: OpenMP threads would wait
        torch.set_num_threads(1)
    env = environment(cuda)
    dtype = DTYPES[args.dtype]
    mode = "gpu" if cuda else "cpu-smoke" if args.cpu_smoke else "no-gpu"
    cache_dir = args.cache_dir or ""
    if mode != "no-gpu":
        cache_dir = cache_dir or tempfile.mkdtemp(prefix="zeroc-gpu-check-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")
    cfg = gpu_checks.GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer,
                               n_head=args.n_head, d_model=args.d_model)
    device_name = env["device"] if cuda else None
    ctx = gpu_checks.Context(
        device="cuda:0" if cuda else "cpu", device_name=device_name, dtype=dtype, model=cfg,
        batch=args.batch, steps=args.steps, warmup=args.warmup, lr=args.lr,
        configs=tuple(args.configs), zero3_precision=args.zero3_precision,
        probe_steps=args.probe_steps, kernel_rows=args.kernel_rows,
        kernel_cols=args.kernel_cols, cache_dir=cache_dir,
        hardware=flops.resolve_peak(args.hardware, device_name, dtype, args.peak_tflops))
    logger.info("gpu_check: %s, torch %s, CUDA %s, triton %s; GPT %s, batch %d, %s, sections "
                "%s, budget %g s, caches in %s", env["device"], env["torch"], env["cuda"],
                env["triton"], cfg, args.batch, args.dtype, ",".join(args.sections),
                args.time_budget_s, cache_dir)
    overall = Budget(args.time_budget_s)
    try:
        records = run_sections(list(gpu_checks.SECTIONS), ctx, overall, args.sections, cuda,
                               args.cpu_smoke)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    status = overall_status(records)
    for name, record in records.items():
        logger.info("%-11s %-13s %6.1f s  %s", name, record["status"], record["wall_s"],
                    record["reason"] or gpu_checks.headline(name, record))
    settings = {k: getattr(args, k) for k in ("d_model", "n_layer", "n_head", "seq", "vocab",
                                              "batch", "steps", "warmup", "probe_steps", "lr",
                                              "dtype", "configs", "zero3_precision",
                                              "kernel_rows", "kernel_cols", "sections",
                                              "time_budget_s")}
    return {"status": status, "ok": None if status == "skipped" else status == "ok",
            "mode": mode, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "environment": env, "settings": {**settings, "cache_dir": cache_dir},
            "hardware": ctx.hardware, "sections": records, "wall_s": overall.elapsed()}


def main(argv: list[str] | None = None) -> int:
    """Run the check, write the JSON; 0 when nothing raised or failed a check, else 1."""
    args = parse_args(argv)
    if not logging.getLogger().handlers:  # this script's progress, others' warnings
        logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    for name in (__name__, "gpu_checks"):
        logging.getLogger(name).setLevel(logging.INFO)
    try:
        payload = check(args)
    except Exception as error:  # outside any one section: still leave a record
        logger.error("gpu_check failed", exc_info=True)
        payload = {"status": "error", "ok": False, "error": error_record(error),
                   "environment": environment(False)}
    write_json(args.json, payload)
    logger.info("gpu_check: %s; wrote %s", payload["status"], args.json)
    return 0 if payload["status"] in ("ok", "skipped") else 1


if __name__ == "__main__":
    sys.exit(main())
