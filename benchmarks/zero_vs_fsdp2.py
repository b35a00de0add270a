"""zeroc ZeRO-3, ZeRO-2 and ZeRO-1 against FSDP2 (eager and compiled) and DDP: step time and memory.

The zoo GPT (about 4.2M parameters by default: width 256, 4 layers, vocab 4096, sequence 128)
trains with AdamW on 2 gloo ranks on CPU, batch 8 x 128 per rank. Each configuration runs in
its own fresh ranks (``zeroc.cli.launch.run_ranks``, one thread per rank), so the peak RSS a rank
reports belongs to that configuration alone:

- ``zeroc_zero3``: ``zeroc.parallelize(model, zero=3)``, then ``torch.compile(model,
  backend="zeroc", options={"bucket_mb": ..., "prefetch": ...})``.
- ``zeroc_zero2``: the same with ``zero=2``.
- ``zeroc_zero1``: the same with ``zero=1`` (whole parameters; gradients reduce-scattered into
  each rank's rows, the updated rows all-gathered after ``opt.step()``: DDP's bytes).
- ``fsdp2``: ``fully_shard`` on every ``layers.{i}`` and then on the root, eager.
- ``fsdp2_compiled``: the same, then ``torch.compile(model, backend="aot_eager")``.
- ``ddp``: ``DistributedDataParallel``, eager.

Per rank: the median wall time of ``--steps`` full steps (forward, backward, AdamW step,
zero_grad) after ``--warmup`` discarded ones (the first compiles); the median CPU time of a step
(``process_time`` of all the rank's threads: less sensitive to other processes' load, blind to
waiting); ``ru_maxrss`` at the end (the peak); the RSS after the timed steps (steady); and the
bytes of parameters, gradients and Adam moments on the rank. A repeat of a configuration
reports its slower rank. ``--repeats`` runs the configurations interleaved (repeat r runs every
configuration once before repeat r + 1 starts), and each number reported is the median over
the repeats, so load from other processes falls on all configurations alike. Ratios: ZeRO-3
against FSDP2 eager, FSDP2 + aot_eager and DDP; ZeRO-2 against DDP and FSDP2 eager.
``--bucket-mb`` and ``--prefetch`` take lists: each zeroc configuration then runs once per
combination.

    python benchmarks/zero_vs_fsdp2.py --repeats 3 --json zero_vs_fsdp2.json
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

sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                 "tests")))
from models.gpt import GPT, GPTConfig, random_token_batch  # noqa: E402

from zeroc.cli.launch import run_ranks  # noqa: E402

CONFIGS = ("zeroc_zero3", "zeroc_zero2", "zeroc_zero1", "fsdp2", "fsdp2_compiled", "ddp")
ZEROC_STAGES = {"zeroc_zero3": 3, "zeroc_zero2": 2, "zeroc_zero1": 1}
# (zeroc configuration, baseline) pairs the ratio table shows.
RATIOS = (("zeroc_zero3", "fsdp2"), ("zeroc_zero3", "fsdp2_compiled"), ("zeroc_zero3", "ddp"),
          ("zeroc_zero2", "ddp"), ("zeroc_zero2", "fsdp2"), ("zeroc_zero1", "ddp"))
# Per-repeat numbers whose median over the repeats is reported.
NUMBERS = ("step_ms", "cpu_ms", "peak_rss_mb", "steady_rss_mb", "model_state_mb", "wall_s")


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
    """One repeat of one configuration over its ranks (the slower rank); ``None`` if it failed."""

    config: str
    step_ms: float | None = None
    step_ms_per_rank: list[float] = field(default_factory=list)
    cpu_ms: float | None = None
    peak_rss_mb: float | None = None
    steady_rss_mb: float | None = None
    model_state_mb: float | None = None
    final_loss: float | None = None
    wall_s: float | None = None
    profile: str | None = None
    plan: str | None = None
    error: str | None = None


@dataclass
class Summary:
    """A configuration's medians over its repeats, and each repeat's step and peak RSS."""

    config: str
    kind: str
    medians: dict[str, float | None]
    step_ms_per_repeat: list[float | None]
    peak_rss_mb_per_repeat: list[float | None]
    final_loss: float | None
    errors: list[str]


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and Adam moments that exist on this rank."""
    total = 0
    for param in model.parameters():
        tensors = [param, param.grad]
        tensors += [optimizer.state.get(param, {}).get(k) for k in ("exp_avg", "exp_avg_sq")]
        for tensor in tensors:
            if tensor is not None:  # a DTensor (FSDP2, zeroc) counts its local shard
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


def build(name: str, setup: Setup) -> tuple[torch.nn.Module, Any]:
    """The model wrapped as configuration ``name`` and the callable that runs a step's forward."""
    torch.compiler.reset()
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
    if name in ZEROC_STAGES:
        import zeroc

        zeroc.parallelize(model, zero=ZEROC_STAGES[name])
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
    model, run = build(name, setup)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    cfg = setup.model
    tokens, targets = random_token_batch(
        cfg.vocab_size, cfg.block_size, setup.batch, None, seed=1 + rank)
    times, cpu_times = [], []
    loss = torch.zeros(())
    for step in range(setup.warmup + setup.steps):
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
    plan = plan_summary(run) if name in ZEROC_STAGES and rank == 0 else None
    return {"times": times, "cpu_times": cpu_times, "loss": float(loss.detach()),
            "peak_rss_mb": peak_rss, "steady_rss_mb": steady_rss, "state_bytes": state,
            "profile": table if rank == 0 else None, "plan": plan}


def measure(label: str, kind: str, setup: Setup, world: int, timeout: float) -> Measurement:
    """Run configuration ``kind`` once in fresh ranks; failures are recorded, not raised."""
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
    result.step_ms_per_rank = [statistics.median(r["times"]) * 1000 for r in ranks]
    result.step_ms = max(result.step_ms_per_rank)
    result.cpu_ms = max(statistics.median(r["cpu_times"]) for r in ranks) * 1000
    for key in ("peak_rss_mb", "steady_rss_mb"):
        setattr(result, key, max(r[key] for r in ranks))
    result.model_state_mb = max(r["state_bytes"] for r in ranks) / 2**20
    result.final_loss = ranks[0]["loss"]
    result.profile = ranks[0]["profile"]
    result.plan = ranks[0]["plan"]
    return result


def summarize(label: str, kind: str, repeats: list[Measurement]) -> Summary:
    """The median over the repeats that ran of every number in ``NUMBERS``."""
    ok = [m for m in repeats if m.error is None]
    medians = {k: statistics.median(getattr(m, k) for m in ok) if ok else None for k in NUMBERS}
    return Summary(label, kind, medians, [m.step_ms for m in repeats],
                   [m.peak_rss_mb for m in repeats], ok[-1].final_loss if ok else None,
                   [m.error for m in repeats if m.error])


def ratio(numerator: float | None, denominator: float | None) -> str:
    """``numerator / denominator`` formatted, or n/a."""
    if numerator is None or denominator is None or denominator == 0:
        return "n/a"
    return f"{numerator / denominator:.2f}x"


def fmt(value: float | None, digits: int = 1) -> str:
    """``value`` with ``digits`` decimals, or n/a."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def report(results: dict[str, Summary]) -> str:
    """The table of medians and the ratio table, as text."""
    rows = []
    for s in results.values():
        m = s.medians
        rows.append([
            s.config, fmt(m["step_ms"]), " / ".join(fmt(v) for v in s.step_ms_per_repeat),
            fmt(m["cpu_ms"]), fmt(m["peak_rss_mb"], 0),
            " / ".join(fmt(v, 0) for v in s.peak_rss_mb_per_repeat),
            fmt(m["steady_rss_mb"], 0), fmt(m["model_state_mb"], 2), fmt(s.final_loss, 4),
            "; ".join(s.errors)])
    absolute = tabulate(rows, disable_numparse=True, headers=[
        "config", "step median (ms)", "per repeat", "CPU ms/step", "peak RSS (MiB)",
        "per repeat", "RSS steady", "model state (MiB)", "final loss", "errors"])
    ratio_rows = []
    for ours in results.values():
        for subject, baseline in RATIOS:
            theirs = next((s for s in results.values() if s.kind == baseline), None)
            if ours.kind != subject or theirs is None:
                continue
            ratio_rows.append([f"{ours.config} / {theirs.config}"] + [
                ratio(ours.medians[k], theirs.medians[k]) for k in NUMBERS[:-1]])
    return absolute + "\n\n" + tabulate(ratio_rows, headers=[
        "ratio of medians", "step", "CPU/step", "peak RSS", "RSS steady", "model state"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--steps", type=int, default=20, help="timed steps per configuration and repeat")
    add("--warmup", type=int, default=5, help="discarded steps before them (compile included)")
    add("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    add("--bucket-mb", default="25", help="zeroc bucket_mb; a comma-separated list runs each")
    add("--prefetch", default="1", help="zeroc prefetch; a comma-separated list runs each")
    add("--repeats", type=int, default=3,
        help="interleaved repeats; the median over them is reported")
    add("--world", type=int, default=2, help="gloo ranks")
    add("--batch", type=int, default=8, help="sequences per rank")
    for name, default in (("seq", 128), ("d-model", 256), ("n-layer", 4), ("n-head", 4),
                          ("vocab", 4096)):
        add(f"--{name}", type=int, default=default)
    add("--timeout", type=float, default=900, help="seconds per configuration and repeat")
    add("--profile", action="store_true",
        help="after each run profile 5 more steps and print rank 0's top ops")
    add("--json", metavar="PATH", help="also write the results (every repeat) as JSON here")
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
        if kind not in ZEROC_STAGES:
            runs.append((kind, kind, setup))
            continue
        for bucket_mb in buckets:
            for prefetch in prefetches:
                label = kind
                if len(buckets) * len(prefetches) > 1:
                    label = f"{kind} b={bucket_mb:g} p={prefetch}"
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
        f"after {args.warmup} warm-up steps, {args.repeats} interleaved repeats, zeroc "
        f"bucket_mb={args.bucket_mb} prefetch={args.prefetch}, load average "
        f"{load_before[0]:.2f}", flush=True)
    runs = variants(args.configs, setup, args.bucket_mb, args.prefetch)
    repeats: dict[str, list[Measurement]] = {label: [] for label, _, _ in runs}
    for repeat in range(args.repeats):
        for label, kind, variant in runs:
            m = measure(label, kind, variant, args.world, args.timeout)
            repeats[label].append(m)
            print(f"  [{repeat + 1}/{args.repeats}] {label}: median {fmt(m.step_ms)} ms, CPU "
                  f"{fmt(m.cpu_ms)} ms, peak RSS {fmt(m.peak_rss_mb, 0)} MiB, wall "
                  f"{fmt(m.wall_s)} s, load {os.getloadavg()[0]:.2f}", flush=True)
            if m.plan and repeat == 0:
                print(f"\n[{label}] plan:\n{m.plan}\n", flush=True)
            if m.profile:
                print(f"\n[{label}] rank 0 profile (5 steps):\n{m.profile}\n", flush=True)
    results = {label: summarize(label, kind, repeats[label]) for label, kind, _ in runs}
    print(f"\nMedians over {args.repeats} interleaved repeats:\n{report(results)}")
    payload = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__, "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "model": asdict(config), "parameters": n_params, "world": args.world,
        "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
        "bucket_mb": args.bucket_mb, "prefetch": args.prefetch, "repeats": args.repeats,
        "medians": {label: asdict(s) for label, s in results.items()},
        "all_repeats": {label: [asdict(m) for m in ms] for label, ms in repeats.items()},
    }
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)
    return payload


if __name__ == "__main__":
    main()
