"""Compile time and steady training-step time of the zoo GPT: zeroc vs aot_eager vs Inductor.

``zeroc`` runs zeroc's graphs on the aten path (the CPU default); ``zeroc-inductor`` is zeroc
with ``options={"kernels": "inductor"}`` (Inductor compiles zeroc's graphs). The "100 steps"
column is the first step plus 99 median steps: what decides the CPU default, compile included.

For each backend, in one process: ``torch._dynamo.reset()``, a fresh model from the same seed,
then the first training step (forward + backward, the one that compiles) is timed as the
compile time. Then the median of ``--steps`` full steps (forward, backward, AdamW step,
zero_grad) after ``--warmup`` steps is the steady step time; these steps run round-robin over
the backends, so that load from other processes falls on all of them alike. Eager PyTorch is
the baseline. The warm-up steps also absorb the recompiles caused by the resets.

Every backend first compiles a tiny unrelated function so that one-time imports are not
charged to whichever backend runs first; the Inductor and zeroc caches point at a fresh
temporary directory so every compile is cold. A backend that fails is reported as n/a.

    python benchmarks/compile_overhead.py --steps 20 --json results.json
    python benchmarks/compile_overhead.py --distributed   # ZeRO-3 and pp=2 vs torch + aot_eager
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

CACHE_ROOT = tempfile.mkdtemp(prefix="zeroc-bench-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(CACHE_ROOT, "inductor"))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                 "tests")))
from models.gpt import GPT, GPTConfig  # noqa: E402

BACKENDS = ("zeroc", "zeroc-inductor", "aot_eager", "inductor")
# Benchmark names that are zeroc with options: name -> (torch.compile backend, options).
ZEROC_VARIANTS = {"zeroc": {}, "zeroc-inductor": {"kernels": "inductor"}}
RUN_STEPS = 100


@dataclass
class Measurement:
    """One backend's numbers; times in seconds, ``None`` where the backend failed."""

    backend: str
    first_step_s: float | None = None
    step_median_s: float | None = None
    step_min_s: float | None = None
    final_loss: float | None = None
    error: str | None = None


def compile_backend(name: str) -> str:
    """The torch.compile backend behind a benchmark name."""
    return "zeroc" if name in ZEROC_VARIANTS else name


def compile_options(name: str) -> dict[str, Any] | None:
    """A benchmark name's options, with the on-disk cache kept out of the measurement."""
    if name in ZEROC_VARIANTS:
        return {**ZEROC_VARIANTS[name], "cache_dir": os.path.join(CACHE_ROOT, "zeroc")}
    return None


def warm_up_backend(backend: str) -> None:
    """Compile and run a tiny function once so the backend's imports are paid before timing."""
    torch.compiler.reset()
    weight = torch.ones(4, requires_grad=True)
    toy = torch.compile(
        lambda x: (x * weight).sin().sum(), backend=compile_backend(backend),
        options=compile_options(backend),
    )
    toy(torch.ones(4)).backward()
    torch.compiler.reset()


@dataclass
class Trainer:
    """A model, its optimizer and the callable that runs it (compiled or eager)."""

    model: GPT
    optimizer: torch.optim.Optimizer
    run: Any
    inputs: torch.Tensor
    targets: torch.Tensor

    def step(self) -> torch.Tensor:
        """One full training step; returns the loss."""
        loss = self.run(self.inputs, self.targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def _record_failure(result: Measurement, error: Exception) -> None:
    message = str(error).splitlines()[0] if str(error) else ""
    result.error = f"{type(error).__name__}: {message}"
    print(f"[{result.backend}] failed:\n{traceback.format_exc()}", file=sys.stderr)


def compile_and_time_first_step(
    backend: str | None, config: GPTConfig, batch: int, result: Measurement
) -> Trainer | None:
    """Build a fresh model, run its first step (the compile) and time it; None on failure."""
    try:
        if backend is not None:
            warm_up_backend(backend)
        torch.compiler.reset()
        model = GPT(config, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        run = model
        if backend is not None:
            run = torch.compile(model, backend=compile_backend(backend),
                                options=compile_options(backend))
        inputs, targets = model.example_batch(batch_size=batch, seed=0)
        trainer = Trainer(model, optimizer, run, inputs, targets)
        start = time.perf_counter()
        run(inputs, targets).backward()
        result.first_step_s = time.perf_counter() - start
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return trainer
    except Exception as error:  # a failing backend is reported, the others still run
        _record_failure(result, error)
        return None


def time_steady_steps(
    trainers: dict[str, Trainer], results: dict[str, Measurement], steps: int, warmup: int
) -> None:
    """Round-robin steps over all trainers, so load from elsewhere hits every backend alike."""
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for round_index in range(warmup + steps):
        for name in list(trainers):
            try:
                start = time.perf_counter()
                loss = trainers[name].step()
                elapsed = time.perf_counter() - start
            except Exception as error:
                _record_failure(results[name], error)
                del trainers[name]
                continue
            if round_index >= warmup:
                times[name].append(elapsed)
            results[name].final_loss = float(loss)
    for name in trainers:
        results[name].step_median_s = statistics.median(times[name])
        results[name].step_min_s = min(times[name])


def ratio(numerator: float | None, denominator: float | None) -> str:
    """``numerator / denominator`` formatted, or n/a."""
    if numerator is None or denominator is None or denominator == 0:
        return "n/a"
    return f"{numerator / denominator:.2f}x"


def fmt(seconds: float | None, unit: float, digits: int) -> str:
    """Seconds scaled by ``unit`` (1 or 1000) with ``digits`` decimals, or n/a."""
    return "n/a" if seconds is None else f"{seconds * unit:.{digits}f}"


def run_total(m: Measurement) -> float | None:
    """Seconds for a ``RUN_STEPS``-step run: the first step plus the rest at the median."""
    if m.first_step_s is None or m.step_median_s is None:
        return None
    return m.first_step_s + (RUN_STEPS - 1) * m.step_median_s


def report(results: dict[str, Measurement], subject: str) -> str:
    """The absolute table and the ratio table as text."""
    rows = [
        [
            m.backend,
            fmt(m.first_step_s, 1, 2),
            fmt(run_total(m), 1, 2),
            fmt(m.step_median_s, 1000, 1),
            fmt(m.step_min_s, 1000, 1),
            "n/a" if m.final_loss is None else f"{m.final_loss:.5f}",
            m.error or "",
        ]
        for m in results.values()
    ]
    absolute = tabulate(
        rows,
        headers=[
            "backend",
            "first step (s)",
            f"{RUN_STEPS} steps (s)",
            "step median (ms)",
            "step min (ms)",
            "final loss",
            "error",
        ],
    )
    ratio_rows = []
    pairs = [(subject, other) for other in ("aot_eager", "inductor", "eager")]
    pairs.append(("zeroc-inductor", "zeroc"))
    for mine, other in pairs:
        ours, theirs = results.get(mine), results.get(other)
        if ours is not None and theirs is not None and mine != other:
            ratio_rows.append(
                [
                    f"{mine}/{other}",
                    ratio(ours.first_step_s, theirs.first_step_s),
                    ratio(run_total(ours), run_total(theirs)),
                    ratio(ours.step_median_s, theirs.step_median_s),
                ]
            )
    ratios = tabulate(ratio_rows, headers=["ratio", "first step", f"{RUN_STEPS} steps",
                                           "step median"])
    return f"{absolute}\n\n{ratios}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per backend")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    parser.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        help=f"comma-separated torch.compile backends (default {BACKENDS})",
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads for the run (default: torch's choice); on a "
        "machine shared with other work, 1 avoids OpenMP threads spinning",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="instead: the first step of ZeRO-3 against FSDP2 + aot_eager and of pp=2 "
        "DualPipeV against torch pipelining + aot_eager stages on 2 gloo ranks, median of 3 "
        "fresh processes each (benchmarks/compile_distributed.py; its own flags there)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps={args.steps} must be >= 1 and --warmup={args.warmup} >= 0")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads={args.threads} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the tables, optionally write JSON; return the JSON object."""
    args = parse_args(argv)
    if args.distributed:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import compile_distributed

        return compile_distributed.main(["--repeats", "3"] + (
            ["--json", args.json] if args.json else []))
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    config = GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
    )
    n_params = sum(p.numel() for p in GPT(config).parameters())
    print(
        f"GPT {config} ({n_params / 1e6:.2f}M parameters), batch {args.batch}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{args.steps} timed steps after {args.warmup} warm-up steps"
    )
    results: dict[str, Measurement] = {}
    trainers: dict[str, Trainer] = {}
    for backend in [None, *backends]:
        name = backend or "eager"
        results[name] = Measurement(name)
        trainer = compile_and_time_first_step(backend, config, args.batch, results[name])
        if trainer is not None:
            trainers[name] = trainer
        print(f"  {name}: first step {fmt(results[name].first_step_s, 1, 2)} s", flush=True)
    time_steady_steps(trainers, results, args.steps, args.warmup)
    print()
    print(report(results, subject=backends[0] if backends else "eager"))
    payload = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "config": asdict(config),
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "results": {name: asdict(m) for name, m in results.items()},
    }
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)
    return payload


if __name__ == "__main__":
    main()
