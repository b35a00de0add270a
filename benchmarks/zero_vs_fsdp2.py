"""zeroc ZeRO-3 against FSDP2 (eager and compiled) and DDP: step time, peak RSS, model state.

The zoo GPT (about 4.2M parameters by default: width 256, 4 layers, vocab 4096, sequence 128)
trains with AdamW on 2 gloo ranks on CPU, batch 8 x 128 per rank. Each configuration runs in
its own fresh ranks (``zeroc.launch.run_ranks``, one thread per rank), so the peak RSS a rank
reports belongs to that configuration alone:

- ``ddp``: ``DistributedDataParallel``, eager.
- ``fsdp2``: ``fully_shard`` on every ``layers.{i}`` and then on the root, eager.
- ``fsdp2_compiled``: the same, then ``torch.compile(model, backend="aot_eager")``.
- ``zeroc``: ``zeroc.parallelize(model, zero=3)``, then ``torch.compile(model,
  backend="zeroc", options={"bucket_mb": ..., "prefetch": ...})``.

Per rank: the median wall time of ``--steps`` full steps (forward, backward, AdamW step,
zero_grad) after ``--warmup`` discarded ones (the first compiles); the median CPU time of a step
(``process_time`` of all the rank's threads: less sensitive to other processes' load, blind to
waiting); ``ru_maxrss`` at the start, after the warm-up and at the end (the peak); the RSS after
the timed steps (steady); and the bytes of parameters, gradients and Adam moments on the rank
(RSS is dominated by the runtime, so model state is counted directly). A configuration reports
its slower rank. ``--repeats`` runs all configurations round-robin and keeps each one's fastest
repeat, so that load from other processes disturbs the comparison less. ``--bucket-mb`` and
``--prefetch`` take lists: zeroc then runs once per combination.

    python benchmarks/zero_vs_fsdp2.py --repeats 2 --json zero_vs_fsdp2.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import resource
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

from zeroc.launch import run_ranks  # noqa: E402

CONFIGS = ("ddp", "fsdp2", "fsdp2_compiled", "zeroc")
SUBJECT = "zeroc"
BASELINES = ("fsdp2", "fsdp2_compiled", "ddp")


@dataclass(frozen=True)
class Setup:
    """What every rank of every configuration trains."""

    model: GPTConfig
    batch: int
    steps: int
    warmup: int
    bucket_mb: float
    prefetch: int
    cache_dir: str
    profile: bool = False


@dataclass
class Measurement:
    """One configuration's numbers over its ranks; ``None`` where it failed."""

    config: str
    step_median_ms: float | None = None
    step_median_ms_per_rank: list[float] = field(default_factory=list)
    step_min_ms: float | None = None
    cpu_median_ms: float | None = None
    peak_rss_mb: float | None = None
    peak_rss_mb_per_rank: list[float] = field(default_factory=list)
    start_peak_rss_mb: float | None = None
    warm_peak_rss_mb: float | None = None
    steady_rss_mb: float | None = None
    repeat_medians_ms: list[float] = field(default_factory=list)
    model_state_mb: float | None = None
    final_loss: float | None = None
    wall_s: float | None = None
    profile: str | None = None
    plan: str | None = None
    error: str | None = None


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and Adam moments that exist on this rank."""
    total = 0
    for param in model.parameters():
        tensors = [param, param.grad]
        tensors += [optimizer.state.get(param, {}).get(k) for k in ("exp_avg", "exp_avg_sq")]
        for tensor in tensors:
            if tensor is not None:  # a DTensor (FSDP2) counts its local shard
                part = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                total += part.numel() * part.element_size()
    return total


def current_rss_mb() -> float:
    """Resident set size of this process now, MiB."""
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def max_rss_mb() -> float:
    """Peak resident set size of this process so far, MiB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(name: str, setup: Setup, rank: int) -> tuple[torch.nn.Module, Any]:
    """The model wrapped as configuration ``name`` and the callable that runs a step's forward."""
    torch._dynamo.reset()
    model = GPT(setup.model, seed=0)
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
        return wrapped, wrapped
    if name in ("fsdp2", "fsdp2_compiled"):
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        if name == "fsdp2":
            return model, model
        return model, torch.compile(model, backend="aot_eager")
    if name == "zeroc":
        import zeroc

        zeroc.parallelize(model, zero=3)
        options = {"bucket_mb": setup.bucket_mb, "prefetch": setup.prefetch,
                   "cache_dir": setup.cache_dir}
        return model, torch.compile(model, backend="zeroc", options=options)
    raise ValueError(f"configuration {name!r} is not known; known: {list(CONFIGS)}")


def profile_steps(run: Any, optimizer: torch.optim.Optimizer, batch: tuple, steps: int) -> str:
    """Top operators by self CPU time over ``steps`` profiled training steps, as text."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run(*batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def plan_summary(compiled: Any) -> str:
    """zeroc's collectives (graph, op, MiB, parameters) and its memory estimate, as text."""
    import zeroc

    plan = zeroc.explain(compiled)
    rows = [[c.graph, c.op, f"{c.bytes / 2**20:.2f}", len(c.params), c.issued_at, c.waited_at]
            for c in plan.collectives]
    text = tabulate(rows, headers=["graph", "op", "MiB", "params", "issued at", "waited at"],
                    disable_numparse=True)
    memory = ", ".join(
        f"rank {m.rank}: peak {m.peak / 2**20:.1f} MiB (activations {m.activations / 2**20:.1f})"
        for m in plan.memory)
    return f"{text}\nmemory estimate: {memory}"


def train_rank(rank: int, world: int, name: str, setup: Setup) -> dict[str, Any]:
    """Build configuration ``name``, train, and return this rank's timings and memory."""
    start_peak_rss = max_rss_mb()
    model, run = build(name, setup, rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    cfg = setup.model
    tokens, targets = random_token_batch(
        cfg.vocab_size, cfg.block_size, setup.batch, None, seed=1 + rank)
    times, cpu_times = [], []
    loss = torch.zeros(())
    warm_peak_rss = start_peak_rss
    for step in range(setup.warmup + setup.steps):
        if step == setup.warmup:
            warm_peak_rss = max_rss_mb()
        dist.barrier()
        begin, cpu_begin = time.perf_counter(), time.process_time()
        loss = run(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= setup.warmup:
            times.append(time.perf_counter() - begin)
            cpu_times.append(time.process_time() - cpu_begin)
    steady_rss = current_rss_mb()
    # Gradients are freed by zero_grad; count them as they are right after a backward.
    run(tokens, targets).backward()
    state = model_state_bytes(model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    peak_rss = max_rss_mb()
    table = profile_steps(run, optimizer, (tokens, targets), 5) if setup.profile else None
    plan = plan_summary(run) if name == "zeroc" and rank == 0 else None
    return {"times": times, "cpu_times": cpu_times, "loss": float(loss.detach()),
            "start_peak_rss_mb": start_peak_rss, "warm_peak_rss_mb": warm_peak_rss,
            "peak_rss_mb": peak_rss, "steady_rss_mb": steady_rss, "state_bytes": state,
            "profile": table if rank == 0 else None, "plan": plan}


def measure(label: str, kind: str, setup: Setup, world: int, timeout: float) -> Measurement:
    """Run configuration ``kind`` in fresh ranks; failures are recorded, not raised."""
    result = Measurement(label)
    begin = time.perf_counter()
    try:
        ranks = run_ranks(train_rank, world, kind, setup, timeout=timeout)
    except Exception as error:  # a failing configuration is reported, the others still run
        first_line = str(error).splitlines()[0] if str(error) else ""
        result.error = f"{type(error).__name__}: {first_line}"
        print(f"[{label}] failed:\n{traceback.format_exc()}", file=sys.stderr)
        return result
    result.wall_s = time.perf_counter() - begin
    result.step_median_ms_per_rank = [statistics.median(r["times"]) * 1000 for r in ranks]
    result.step_median_ms = max(result.step_median_ms_per_rank)
    result.step_min_ms = min(min(r["times"]) for r in ranks) * 1000
    result.cpu_median_ms = max(statistics.median(r["cpu_times"]) for r in ranks) * 1000
    result.peak_rss_mb_per_rank = [r["peak_rss_mb"] for r in ranks]
    result.peak_rss_mb = max(result.peak_rss_mb_per_rank)
    result.start_peak_rss_mb = max(r["start_peak_rss_mb"] for r in ranks)
    result.warm_peak_rss_mb = max(r["warm_peak_rss_mb"] for r in ranks)
    result.steady_rss_mb = max(r["steady_rss_mb"] for r in ranks)
    result.model_state_mb = max(r["state_bytes"] for r in ranks) / 2**20
    result.final_loss = ranks[0]["loss"]
    result.profile = ranks[0]["profile"]
    result.plan = ranks[0]["plan"]
    return result


def best_of(repeats: list[Measurement]) -> Measurement:
    """The repeat with the lowest step median (the least disturbed on a shared machine)."""
    timed = [m for m in repeats if m.step_median_ms is not None]
    if not timed:
        return repeats[-1]
    best = min(timed, key=lambda m: m.step_median_ms)
    best.repeat_medians_ms = [m.step_median_ms for m in timed]
    return best


def ratio(numerator: float | None, denominator: float | None) -> str:
    """``numerator / denominator`` formatted, or n/a."""
    if numerator is None or denominator is None or denominator == 0:
        return "n/a"
    return f"{numerator / denominator:.2f}x"


def fmt(value: float | None, digits: int = 1) -> str:
    """``value`` with ``digits`` decimals, or n/a."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def report(results: dict[str, Measurement]) -> str:
    """The absolute table and the ratio table as text."""
    rows = [
        [m.config, fmt(m.step_median_ms), " / ".join(fmt(v) for v in m.repeat_medians_ms),
         fmt(m.step_min_ms), fmt(m.cpu_median_ms), fmt(m.peak_rss_mb, 0),
         fmt(m.start_peak_rss_mb, 0), fmt(m.warm_peak_rss_mb, 0), fmt(m.steady_rss_mb, 0),
         fmt(m.model_state_mb, 2), fmt(m.final_loss, 4), m.error or ""]
        for m in results.values()
    ]
    absolute = tabulate(rows, headers=[
        "config", "step median (ms)", "medians per repeat", "step min (ms)", "CPU ms/step",
        "peak RSS (MiB)", "at start", "after warm-up", "RSS steady", "model state (MiB)",
        "final loss", "error"])
    ratio_rows = []
    for label, ours in results.items():
        for other in BASELINES:
            if not label.startswith(SUBJECT) or other not in results:
                continue
            theirs = results[other]
            ratio_rows.append([
                f"{label}/{other}",
                ratio(ours.step_median_ms, theirs.step_median_ms),
                ratio(ours.cpu_median_ms, theirs.cpu_median_ms),
                ratio(ours.peak_rss_mb, theirs.peak_rss_mb),
                ratio(ours.steady_rss_mb, theirs.steady_rss_mb),
                ratio(ours.model_state_mb, theirs.model_state_mb),
            ])
    ratios = tabulate(ratio_rows, headers=[
        "ratio", "step median", "CPU/step", "peak RSS", "RSS steady", "model state"])
    return f"{absolute}\n\n{ratios}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--steps", type=int, default=20, help="timed steps per configuration")
    add("--warmup", type=int, default=5, help="discarded steps before them (compile included)")
    add("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    add("--bucket-mb", default="25", help="zeroc bucket_mb; a comma-separated list runs each")
    add("--prefetch", default="1", help="zeroc prefetch; a comma-separated list runs each")
    add("--repeats", type=int, default=1, help="round-robin repeats; the fastest is reported")
    add("--world", type=int, default=2, help="gloo ranks")
    add("--batch", type=int, default=8, help="sequences per rank")
    for name, default in (("seq", 128), ("d-model", 256), ("n-layer", 4), ("n-head", 4),
                          ("vocab", 4096)):
        add(f"--{name}", type=int, default=default)
    add("--timeout", type=float, default=900, help="seconds per configuration")
    add("--profile", action="store_true", help="profile 5 more steps, print rank 0's top ops")
    add("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error(f"--steps={args.steps} and --warmup={args.warmup} must be >= 1")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        parser.error(f"--configs={args.configs!r}: allowed are {list(CONFIGS)}")
    args.configs = configs
    try:
        args.bucket_mb = [float(v) for v in args.bucket_mb.split(",")]
        args.prefetch = [int(v) for v in args.prefetch.split(",")]
    except ValueError as error:
        parser.error(f"--bucket-mb / --prefetch: {error}")
    if min(args.bucket_mb) <= 0 or min(args.prefetch) < 0:
        parser.error(f"--bucket-mb={args.bucket_mb} must be > 0, --prefetch={args.prefetch} >= 0")
    if args.world < 1 or args.repeats < 1:
        parser.error(f"--world={args.world} and --repeats={args.repeats} must be >= 1")
    return args


def variants(configs: list[str], setup: Setup, buckets: list[float], prefetches: list[int]
             ) -> list[tuple[str, str, Setup]]:
    """``(label, configuration, setup)`` to run; zeroc once per bucket size and prefetch."""
    runs = []
    for kind in configs:
        if kind != SUBJECT:
            runs.append((kind, kind, setup))
            continue
        for bucket_mb in buckets:
            for prefetch in prefetches:
                label = SUBJECT
                if len(buckets) * len(prefetches) > 1:
                    label = f"{SUBJECT} b={bucket_mb:g} p={prefetch}"
                variant = dataclasses.replace(setup, bucket_mb=bucket_mb, prefetch=prefetch)
                runs.append((label, kind, variant))
    return runs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every configuration, print the tables, optionally write JSON; return the JSON object."""
    args = parse_args(argv)
    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer,
                       n_head=args.n_head, d_model=args.d_model)
    setup = Setup(config, args.batch, args.steps, args.warmup, args.bucket_mb[0],
                  args.prefetch[0], tempfile.mkdtemp(prefix="zeroc-bench-"), args.profile)
    n_params = sum(p.numel() for p in GPT(config).parameters())
    load_before = os.getloadavg()
    print(
        f"GPT {config} ({n_params / 1e6:.2f}M parameters), {args.world} gloo ranks, batch "
        f"{args.batch}x{args.seq} per rank, torch {torch.__version__}, {args.steps} timed steps "
        f"after {args.warmup} warm-up steps, zeroc bucket_mb={args.bucket_mb} "
        f"prefetch={args.prefetch}, load average {load_before[0]:.2f}", flush=True)
    runs = variants(args.configs, setup, args.bucket_mb, args.prefetch)
    repeats: dict[str, list[Measurement]] = {label: [] for label, _, _ in runs}
    for repeat in range(args.repeats):
        for label, kind, variant in runs:
            m = measure(label, kind, variant, args.world, args.timeout)
            repeats[label].append(m)
            print(f"  [{repeat + 1}/{args.repeats}] {label}: median {fmt(m.step_median_ms)} "
                  f"ms, peak RSS {fmt(m.peak_rss_mb, 0)} MiB, wall {fmt(m.wall_s)} s, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
            if m.plan and repeat == 0:
                print(f"\n[{label}] plan:\n{m.plan}\n", flush=True)
            if m.profile:
                print(f"\n[{label}] rank 0 profile (5 steps):\n{m.profile}\n", flush=True)
    results = {name: best_of(runs) for name, runs in repeats.items()}
    print(f"\n{report(results)}")
    payload = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__, "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "model": asdict(config), "parameters": n_params, "world": args.world,
        "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
        "bucket_mb": args.bucket_mb, "prefetch": args.prefetch, "repeats": args.repeats,
        "results": {name: asdict(m) for name, m in results.items()},
        "all_repeats": {name: [asdict(m) for m in runs] for name, runs in repeats.items()},
    }
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)
    return payload


if __name__ == "__main__":
    main()
