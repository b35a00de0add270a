"""zeroc pipelines against torch.distributed.pipelining: step time, CPU time, peak RSS, losses.

The zoo GPT (8 blocks, width 256, 4 heads, vocab 2048, sequence 128 by default: 7.4M
parameters), its head UNTIED from the token embedding on both sides (torch pipelining cannot
tie across stages), trains with AdamW on ``--world`` gloo ranks (4 by default; one thread
each), a global batch of 16 in 8 micro-batches. ``--repeats`` runs every configuration once per
repeat, interleaved, and reports the median over the repeats of the step time, CPU time, peak
RSS and model state (parameters, gradients and Adam state a rank holds). Each configuration runs in
fresh ranks (``zeroc.cli.launch.run_ranks``), so a rank's peak RSS is that configuration's alone:

- ``zeroc_dualpipev`` / ``zeroc_1f1b``: ``zeroc.parallelize(model, zero=0, pp=4)`` (replicated
  parameters, dp=1: no sharding, as in torch's pipelining alone) and ``torch.compile(model,
  backend="zeroc", options={"schedule", "microbatches", "split_points"})``, the split pinned to
  torch's: one block per stage for dualpipev's 8 stages, two for 1f1b's 4. By default with
  ``"kernels": "inductor"`` (``--zeroc-options``): Inductor's C++ kernels for zeroc's graphs,
  which cost a longer first step (35-70 s here) and give the CPU's fastest step after it;
  ``--zeroc-options '{}'`` measures the aten default instead.
- ``torch_dualpipev`` / ``torch_1f1b``: the same GPT cut by hand into stage modules (embeddings
  first, ``ln_f`` + head last), ``PipelineStage`` each, ``ScheduleDualPipeV`` (stages r and
  2P-1-r on rank r) or ``Schedule1F1B``, ``loss_fn`` = cross-entropy.

Per rank: median wall and CPU time of ``--steps`` steps (barrier, forward + backward, AdamW,
zero_grad) after ``--warmup`` ones, ``ru_maxrss``, every step's loss (each pair must agree).
For zeroc the executor's action timings are summed by kind (F, B, I, W, F&B, p2p).

``--dp N`` (default 1) adds data parallelism: ``--world`` pipeline ranks times N replicas, on
``world * N`` gloo ranks laid out pp-major as zeroc does (rank = pp_index * N + dp_index,
``zeroc.runtime.mesh``). zeroc then runs ``zeroc.parallelize(model, zero=3, pp=world)``
(per-step ZeRO-3 over each position's replicas); torch runs torchtitan's composition: a
``DeviceMesh`` ("pp", "dp"), FSDP2 ``fully_shard`` on every block and then on each stage module
over ``mesh["dp"]``, the stages on ``mesh["pp"]``'s group (``torch_pipelines.build_torch``).
Replica d trains rows ``[d * B/N, (d + 1) * B/N)`` of the global batch B in ``--microbatches``
micro-batches, on both sides, so the gradient is that of the global batch's mean loss; the
loss reported is the mean of the replicas' losses (equal token counts: the global mean).

Per rank, one extra step after the timed ones (same work, untimed: the dispatch mode slows
every op) counts the bytes its collectives and p2p send (``torch_pipelines.CommBytes``:
ring-algorithm estimates per rank); "MB moved per step" is the largest rank's, "all ranks"
their sum (what a link every rank shares carries: ``benchmarks/slow_link.py``).

    python benchmarks/pipeline_vs_torch.py --world 2 --repeats 3 --json pipeline.json
    python benchmarks/pipeline_vs_torch.py --world 2 --dp 2 --zeroc-options '{}' --json pp_dp.json
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
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch import nn

sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                 "tests")))
from models.gpt import GPTConfig, random_token_batch  # noqa: E402
from torch_pipelines import (  # noqa: E402, F401  (StageModule, cross_entropy: re-exported)
    StageModule,
    build_torch,
    count_step,
    cross_entropy,
    num_stages,
    untied_gpt,
)

from zeroc.cli.launch import run_ranks  # noqa: E402

CONFIGS = ("zeroc_dualpipev", "torch_dualpipev", "zeroc_1f1b", "torch_1f1b")
# Ablations, run only when named in --configs: zeroc with blocking p2p (every receive and send
# of a p2p group waited right there, as batch_isend_irecv followed by wait() would).
ABLATIONS = ("zeroc-blocking_dualpipev", "zeroc-blocking_1f1b")
PAIRS = (("zeroc_dualpipev", "torch_dualpipev"), ("zeroc_1f1b", "torch_1f1b"),
         ("zeroc_dualpipev", "zeroc-blocking_dualpipev"), ("zeroc_1f1b", "zeroc-blocking_1f1b"))
KINDS = ("F", "B", "I", "W", "F&B", "p2p", "gaps", "outside")


@dataclass(frozen=True)
class Setup:
    """What every rank of every configuration trains."""

    model: GPTConfig
    batch: int
    microbatches: int
    steps: int
    warmup: int
    cache_dir: str
    zeroc_options: tuple[tuple[str, Any], ...] = ()  # extra compile options (--zeroc-options)
    dp: int = 1  # data-parallel replicas (--dp); pipeline ranks = world // dp


def replica_rows(batch: tuple[torch.Tensor, ...], replica: int, dp: int) -> tuple:
    """Replica ``replica``'s contiguous share of the global batch's rows."""
    per = batch[0].shape[0] // dp
    return tuple(t[replica * per:(replica + 1) * per] for t in batch)


def build_zeroc(schedule: str, setup: Setup, pp: int):
    """The parallelized GPT, its compiled form and a ``step(x, y) -> loss``: replicated
    parameters at dp=1 (as torch's pipelining alone), ZeRO-3 over the replicas at dp > 1."""
    import zeroc

    model = zeroc.parallelize(untied_gpt(setup.model), zero=3 if setup.dp > 1 else 0, pp=pp)
    stages = num_stages(schedule, pp)
    per = setup.model.n_layer // stages
    options = {"schedule": schedule, "microbatches": setup.microbatches,
               "split_points": [f"layers.{s * per}" for s in range(1, stages)],
               "cache_dir": setup.cache_dir, **dict(setup.zeroc_options)}
    compiled = torch.compile(model, backend="zeroc", options=options)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = compiled(x, y)
        loss.backward()
        return float(loss.detach())

    return model, compiled, step


def block_on_p2p() -> None:
    """Make this rank's zeroc pipeline wait for every message of a p2p group at the group
    itself (its receives and its sends), instead of right before the compute that reads a
    received value: the blocking executor the ``zeroc-blocking_*`` ablations measure."""
    from zeroc.runtime.pipeline.messages import StepMessages

    overlapped = StepMessages.exchange

    def exchange(self, position, plan):
        overlapped(self, position, plan)
        self.end()  # waits for every message posted so far: this group's receives and sends

    StepMessages.exchange = exchange


def action_kind(label: str) -> str:
    """``F3@s1`` -> F, ``F4@s0&B0@s7`` -> F&B, ``SEND_F3@s1->r2 ...`` -> p2p."""
    if "&" in label:
        return "F&B"
    return "p2p" if label.startswith(("SEND", "RECV")) else label.split("@")[0].rstrip("0123456789")


def add_action_times(totals: dict[str, float], compiled: Any, rank: int, step_s: float) -> None:
    """Add this rank's last-step seconds per action kind, gaps between actions and the time
    of the step outside the executor (Dynamo call, gradient hand-off, AdamW) to ``totals``."""
    from zeroc.frontend.session import SESSION_ATTR, wrapper_of

    timings = getattr(wrapper_of(compiled), SESSION_ATTR).pipelined_executor().timings
    labels, spans = timings.labels[rank], timings.times[rank]
    for label, (start, end) in zip(labels, spans, strict=True):
        kind = action_kind(label)
        totals[kind] = totals.get(kind, 0.0) + end - start
    # Waits for receives happen right before the compute that reads them: p2p time too.
    waited = sum(timings.waits[rank]) if timings.waits else 0.0
    totals["p2p"] = totals.get("p2p", 0.0) + waited
    busy = sum(end - start for start, end in spans)
    inside = spans[-1][1] - spans[0][0]
    totals["gaps"] = totals.get("gaps", 0.0) + inside - busy - waited
    totals["outside"] = totals.get("outside", 0.0) + step_s - inside


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state (after a step, before
    ``zero_grad``); a DTensor counts its local shard, a released parameter (held by another
    pipeline rank: meta or empty) nothing."""
    total = 0
    for param in model.parameters():
        tensors = [param, param.grad, *optimizer.state.get(param, {}).values()]
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
                part = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                if not part.is_meta:  # a parameter another pipeline rank holds
                    total += part.numel() * part.element_size()
    return total


def max_rss_mb() -> float:
    """Peak resident set size of this process so far, MiB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train_rank(rank: int, world: int, config: str, setup: Setup) -> dict[str, Any]:
    """Build ``config`` on this rank, train, return timings, losses, memory, action times."""
    start_rss = max_rss_mb()
    system, schedule = config.split("_", 1)
    pp, replica = world // setup.dp, rank % setup.dp  # pp-major, as zeroc lays ranks out
    torch.compiler.reset()
    compiled = None
    if system.startswith("zeroc"):
        if system == "zeroc-blocking":
            block_on_p2p()
        model, compiled, step = build_zeroc(schedule, setup, pp)
        import zeroc

        if setup.dp > 1 and zeroc.data_parallel_rank(model) != replica:
            raise RuntimeError(f"rank {rank}: zeroc's replica {zeroc.data_parallel_rank(model)}"
                               f" is not rank % dp = {replica}")
    else:
        model, step = build_torch(schedule, setup.model, setup.microbatches, rank, pp, setup.dp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    cfg = setup.model
    x, y = replica_rows(random_token_batch(cfg.vocab_size, cfg.block_size, setup.batch, None,
                                           seed=1), replica, setup.dp)
    times, cpu_times, losses, actions = [], [], [], {}
    first_step_s, warm_rss = 0.0, start_rss
    state_bytes = 0
    for index in range(setup.warmup + setup.steps):
        if index == setup.warmup:
            warm_rss = max_rss_mb()
        dist.barrier()
        begin, cpu_begin = time.perf_counter(), time.process_time()
        loss = step(x, y)
        optimizer.step()
        if index == setup.warmup + setup.steps - 1:
            state_bytes = model_state_bytes(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - begin
        cpu_elapsed = time.process_time() - cpu_begin
        losses.append(loss)
        if index == 0:
            first_step_s = elapsed
        if index >= setup.warmup:
            times.append(elapsed)
            cpu_times.append(cpu_elapsed)
            if compiled is not None:
                add_action_times(actions, compiled, rank // setup.dp, elapsed)
    peak_rss = max_rss_mb()
    counter = count_step(step, compiled, optimizer, x, y)
    return {
        "times": times, "cpu_times": cpu_times, "losses": losses, "first_step_s": first_step_s,
        "start_rss_mb": start_rss, "warm_rss_mb": warm_rss, "peak_rss_mb": peak_rss,
        "params": sum(p.numel() for p in model.parameters()),
        "optimized_params": sum(p.numel() for p in model.parameters() if p in optimizer.state),
        "action_ms": {k: 1000 * v / setup.steps for k, v in actions.items()},
        "model_state_bytes": state_bytes, "replica": replica,
        "sent_bytes": counter.sent, "sent_ops": counter.ops,
    }


@dataclass
class Measurement:
    """One configuration's numbers over its ranks; ``error`` where it failed."""

    config: str
    step_median_ms: float | None = None
    step_median_ms_per_rank: list[float] | None = None
    cpu_median_ms_per_rank: list[float] | None = None
    cpu_total_ms: float | None = None
    peak_rss_mb: float | None = None
    peak_rss_mb_per_rank: list[float] | None = None
    start_rss_mb: float | None = None
    warm_rss_mb: float | None = None
    first_step_s: float | None = None
    losses: list[float] | None = None
    params_per_rank: list[int] | None = None
    optimized_params_per_rank: list[int] | None = None
    action_ms_per_rank: list[dict[str, float]] | None = None
    model_state_mb: float | None = None
    model_state_mb_per_rank: list[float] | None = None
    wall_s: float | None = None
    error: str | None = None
    step_ms_per_repeat: list[float | None] | None = None
    # Bytes sent per step (CommBytes, on the extra counted step), MB = 1e6 bytes.
    mb_moved_per_step: float | None = None  # the largest rank's
    mb_moved_per_step_total: float | None = None  # all ranks together: what a shared link carries
    mb_moved_per_rank: list[float] | None = None
    mb_moved_by_kind: dict[str, float] | None = None  # all ranks together, per kind
    comm_ops_by_kind: dict[str, int] | None = None  # all ranks together, per kind


def measure(config: str, setup: Setup, world: int, timeout: float) -> Measurement:
    """Run ``config`` in fresh ranks; a failure is recorded, not raised."""
    result = Measurement(config)
    begin = time.perf_counter()
    try:
        ranks = run_ranks(train_rank, world, config, setup, timeout=timeout)
    except Exception as error:  # a failing configuration is reported, the others still run
        result.error = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        print(f"[{config}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return result
    result.wall_s = time.perf_counter() - begin
    result.step_median_ms_per_rank = [statistics.median(r["times"]) * 1000 for r in ranks]
    result.step_median_ms = max(result.step_median_ms_per_rank)
    result.cpu_median_ms_per_rank = [statistics.median(r["cpu_times"]) * 1000 for r in ranks]
    result.cpu_total_ms = sum(result.cpu_median_ms_per_rank)
    result.peak_rss_mb_per_rank = [r["peak_rss_mb"] for r in ranks]
    result.peak_rss_mb = max(result.peak_rss_mb_per_rank)
    result.start_rss_mb = max(r["start_rss_mb"] for r in ranks)
    result.warm_rss_mb = max(r["warm_rss_mb"] for r in ranks)
    result.first_step_s = max(r["first_step_s"] for r in ranks)
    # torch reports a replica's loss on its rank holding the last stage, zeroc on every rank
    # of the replica; the replicas' mean is the global batch's (equal token counts).
    replicas = {}
    for r in ranks:
        if r["losses"][0] is not None:
            replicas.setdefault(r["replica"], r["losses"])
    result.losses = [statistics.fmean(step) for step in zip(*replicas.values(), strict=True)]
    result.mb_moved_per_rank = [sum(r["sent_bytes"].values()) / 1e6 for r in ranks]
    result.mb_moved_per_step = max(result.mb_moved_per_rank)
    result.mb_moved_per_step_total = sum(result.mb_moved_per_rank)
    result.mb_moved_by_kind = {k: sum(r["sent_bytes"][k] for r in ranks) / 1e6
                               for k in ranks[0]["sent_bytes"]}
    result.comm_ops_by_kind = {k: sum(r["sent_ops"][k] for r in ranks)
                               for k in ranks[0]["sent_ops"]}
    result.params_per_rank = [r["params"] for r in ranks]
    result.optimized_params_per_rank = [r["optimized_params"] for r in ranks]
    if any(r["action_ms"] for r in ranks):
        result.action_ms_per_rank = [r["action_ms"] for r in ranks]
    result.model_state_mb_per_rank = [r["model_state_bytes"] / 2**20 for r in ranks]
    result.model_state_mb = max(result.model_state_mb_per_rank)
    return result


MEDIAN_FIELDS = ("step_median_ms", "cpu_total_ms", "peak_rss_mb", "model_state_mb")


def median_of(repeats: list[Measurement]) -> Measurement:
    """The last repeat that ran, with each of ``MEDIAN_FIELDS`` the median over the repeats."""
    ok = [m for m in repeats if m.error is None]
    if not ok:
        return repeats[-1]
    medians = {k: statistics.median(getattr(m, k) for m in ok) for k in MEDIAN_FIELDS}
    return dataclasses.replace(ok[-1], **medians,
                               step_ms_per_repeat=[m.step_median_ms for m in repeats])


def fmt(value: float | None, digits: int = 1) -> str:
    """``value`` with ``digits`` decimals, or n/a."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def ratio(ours: float | None, theirs: float | None) -> str:
    """``ours / theirs`` formatted, or n/a."""
    return "n/a" if ours is None or not theirs else f"{ours / theirs:.2f}x"


def per_rank(values: list[float] | None, scale: float = 1.0, digits: int = 0) -> str:
    """``a / b / c`` of per-rank values divided by ``scale``."""
    return " / ".join(f"{v / scale:.{digits}f}" for v in values or [])


def report(results: dict[str, Measurement]) -> str:
    """Time and memory tables, the zeroc/torch ratios and zeroc's per-action times, as text."""
    rows = [[m.config, fmt(m.step_median_ms),
             " / ".join(fmt(v) for v in m.step_ms_per_repeat or []),
             per_rank(m.step_median_ms_per_rank, digits=1), fmt(m.cpu_total_ms),
             per_rank(m.cpu_median_ms_per_rank, digits=1), fmt(m.first_step_s, 2),
             fmt(m.losses[0], 5) if m.losses else "n/a",
             fmt(m.losses[-1], 5) if m.losses else "n/a", m.error or ""]
            for m in results.values()]
    text = tabulate(rows, headers=[
        "config", "step median (ms)", "per repeat", "median per rank (last repeat)",
        "CPU ms/step (sum)", "CPU per rank", "first step (s)", "loss step 1", "loss last",
        "error"])
    rows = [[m.config, fmt(m.peak_rss_mb, 0), per_rank(m.peak_rss_mb_per_rank),
             fmt(m.start_rss_mb, 0), fmt(m.warm_rss_mb, 0),
             per_rank(m.params_per_rank, 1e6, 2), per_rank(m.optimized_params_per_rank, 1e6, 2),
             fmt(m.model_state_mb, 2), per_rank(m.model_state_mb_per_rank, digits=2)]
            for m in results.values()]
    text += "\n\n" + tabulate(rows, headers=[
        "config", "peak RSS (MiB)", "per rank", "at start", "peak after warm-up",
        "params held (M)", "params optimized (M)", "model state (MiB, max)", "per rank"])
    rows = [[m.config, fmt(m.mb_moved_per_step, 3), per_rank(m.mb_moved_per_rank, digits=3),
             fmt(m.mb_moved_per_step_total, 3),
             ", ".join(f"{k} {v:.3f} ({(m.comm_ops_by_kind or {}).get(k, 0)})"
                       for k, v in (m.mb_moved_by_kind or {}).items() if v)]
            for m in results.values()]
    text += "\n\n" + tabulate(rows, headers=[
        "config", "MB moved per step (max rank)", "per rank", "all ranks",
        "all ranks by kind: MB (ops)"])
    ratio_rows = []
    for ours, theirs in PAIRS:
        if ours not in results or theirs not in results:
            continue
        a, b = results[ours], results[theirs]
        diff = (max(abs(p - q) for p, q in zip(a.losses, b.losses, strict=True))
                if a.losses and b.losses else None)
        ratio_rows.append([f"{ours} / {theirs}", ratio(a.step_median_ms, b.step_median_ms),
                           ratio(a.cpu_total_ms, b.cpu_total_ms),
                           ratio(a.peak_rss_mb, b.peak_rss_mb),
                           ratio(a.model_state_mb, b.model_state_mb),
                           ratio(a.mb_moved_per_step, b.mb_moved_per_step), fmt(diff, 7)])
    text += "\n\n" + tabulate(ratio_rows, headers=[
        "ratio of medians", "step", "CPU per step", "peak RSS", "model state", "MB moved",
        "max |loss diff| over steps"])
    for m in results.values():
        if not m.action_ms_per_rank:
            continue
        breakdown = [[rank, fmt(m.step_median_ms_per_rank[rank])]
                     + [fmt(times.get(k, 0.0)) for k in KINDS]
                     for rank, times in enumerate(m.action_ms_per_rank)]
        text += f"\n\n{m.config}: mean ms per timed step by action kind\n" + tabulate(
            breakdown, headers=["rank", "step median", *KINDS])
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3, help="discarded steps before them")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated subset of {list(CONFIGS + ABLATIONS)}")
    parser.add_argument("--world", type=int, default=4, help="pipeline ranks (pp)")
    parser.add_argument("--dp", type=int, default=1,
                        help="data-parallel replicas: world * dp gloo ranks (ZeRO-3 / FSDP2)")
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved repeats; the median over them is reported")
    for name, default in (("--microbatches", 8), ("--seq", 128), ("--d-model", 256),
                          ("--n-layer", 8), ("--n-head", 4), ("--vocab", 2048)):
        parser.add_argument(name, type=int, default=default)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--zeroc-options", default='{"kernels": "inductor"}', metavar="JSON",
                        help="extra zeroc compile options (default: Inductor's kernels, the "
                             "CPU's fastest steady step); '{}' for the aten default")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.repeats < 1:
        parser.error(f"--steps={args.steps}, --warmup={args.warmup} and --repeats="
                     f"{args.repeats} must be >= 1")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS + ABLATIONS]
    if unknown or not args.configs:
        parser.error(f"--configs: {unknown or 'empty'} not allowed; allowed are "
                     f"{list(CONFIGS + ABLATIONS)}")
    if args.world < 2 or args.n_layer % (2 * args.world):
        parser.error(f"--world={args.world} must be >= 2 and --n-layer={args.n_layer} a "
                     f"multiple of 2 * world (dualpipev's stages)")
    if args.dp < 1:
        parser.error(f"--dp={args.dp} must be >= 1")
    if args.microbatches < 2 * args.world or args.batch % (args.dp * args.microbatches):
        parser.error(f"--microbatches={args.microbatches} must be >= 2 * world and dp * "
                     f"microbatches (dp={args.dp}) divide --batch={args.batch}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every configuration, print the tables, optionally write JSON; return the JSON object."""
    args = parse_args(argv)
    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer,
                       n_head=args.n_head, d_model=args.d_model)
    setup = Setup(model=config, batch=args.batch, microbatches=args.microbatches,
                  steps=args.steps, warmup=args.warmup,
                  cache_dir=tempfile.mkdtemp(prefix="zeroc-bench-"),
                  zeroc_options=tuple(sorted(json.loads(args.zeroc_options).items())),
                  dp=args.dp)
    ranks = args.world * args.dp
    n_params = sum(p.numel() for p in untied_gpt(config).parameters())
    load_before = os.getloadavg()
    layout = "" if args.dp == 1 else f" (pp={args.world} x dp={args.dp})"
    print(f"GPT {config} untied ({n_params / 1e6:.2f}M parameters), {ranks} gloo ranks{layout}, "
          f"batch {args.batch}x{args.seq} in {args.microbatches} micro-batches, torch "
          f"{torch.__version__}, {args.steps} timed steps after {args.warmup} warm-up steps, "
          f"load average {load_before[0]:.2f}", flush=True)
    repeats: dict[str, list[Measurement]] = {name: [] for name in args.configs}
    for repeat in range(args.repeats):
        for name in args.configs:
            m = measure(name, setup, ranks, args.timeout)
            repeats[name].append(m)
            print(f"  [{repeat + 1}/{args.repeats}] {name}: median {fmt(m.step_median_ms)} ms, "
                  f"peak RSS {fmt(m.peak_rss_mb, 0)} MiB, model state "
                  f"{fmt(m.model_state_mb, 2)} MiB, wall {fmt(m.wall_s)} s, load "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
    results = {name: median_of(runs) for name, runs in repeats.items()}
    print(f"\nMedians over {args.repeats} interleaved repeats:")
    print(report(results))
    payload = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__, "python": platform.python_version(),
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "model": asdict(config), "parameters": n_params, "args": vars(args),
        "results": {name: asdict(m) for name, m in results.items()},
        "all_repeats": {name: [asdict(m) for m in runs] for name, runs in repeats.items()}}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)
    return payload


if __name__ == "__main__":
    main()
