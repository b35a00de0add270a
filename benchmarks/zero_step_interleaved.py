"""Step time of the ZeRO configurations side by side in one pair of ranks, steps interleaved.

``zero_vs_fsdp2.py`` runs each configuration in fresh ranks (so its peak RSS is its own) and
interleaves whole runs; on a shared machine the load still changes between two runs of a
minute each. Here every rank builds all the configurations at once (the models of
``zero_vs_fsdp2.build``), warms each up, and then runs rounds in which every configuration
takes ``--steps-per-round`` training steps before the next one does, so load from other
processes falls on all of them within seconds of each other. Reported per configuration: the
median over all timed steps of the slower rank's wall time and process CPU time, and the
ratios the ZeRO targets are stated in. Memory is not measured here (all models share one
process).

    python benchmarks/zero_step_interleaved.py --rounds 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                 "tests")))
from models.gpt import GPTConfig, random_token_batch  # noqa: E402
from zero_vs_fsdp2 import CONFIGS, RATIOS, Setup, build  # noqa: E402

from zeroc.cli.launch import run_ranks  # noqa: E402


def interleaved_rank(rank: int, world: int, names: list[str], setup: Setup, rounds: int,
                     per_round: int) -> dict[str, tuple[list[float], list[float]]]:
    """Build every configuration, then time rounds of ``per_round`` steps of each in turn."""
    reset = torch._dynamo.reset
    torch._dynamo.reset = lambda: None  # build() resets Dynamo; keep the others' compiles
    # Every model's modules carry their own hooks, so each block's code is compiled once per
    # compiled model: more than Dynamo's default limit of 8 variants of one frame.
    torch._dynamo.config.recompile_limit = 64
    try:
        built = {}
        cfg = setup.model
        tokens, targets = random_token_batch(
            cfg.vocab_size, cfg.block_size, setup.batch, None, seed=1 + rank)
        for name in names:
            model, run = build(name, setup)
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
            built[name] = (run, optimizer)
            for _ in range(setup.warmup):
                run(tokens, targets).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    finally:
        torch._dynamo.reset = reset
    times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in names}
    for _ in range(rounds):
        for name, (run, optimizer) in built.items():
            for _ in range(per_round):
                dist.barrier()
                begin, cpu_begin = time.perf_counter(), time.process_time()
                run(tokens, targets).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                times[name][0].append(time.perf_counter() - begin)
                times[name][1].append(time.process_time() - cpu_begin)
    return times


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run, print the medians and ratios, return them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    add("--rounds", type=int, default=15, help="rounds; each runs every configuration")
    add("--steps-per-round", type=int, default=1, help="steps of a configuration per round")
    add("--warmup", type=int, default=3, help="untimed steps per configuration (compiles)")
    add("--world", type=int, default=2, help="gloo ranks")
    add("--batch", type=int, default=8, help="sequences per rank")
    add("--timeout", type=float, default=3000, help="seconds for the whole run")
    args = parser.parse_args(argv)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not names or any(n not in CONFIGS for n in names):
        parser.error(f"--configs={args.configs!r}: allowed are {list(CONFIGS)}")
    if min(args.rounds, args.steps_per_round, args.warmup, args.world) < 1:
        parser.error("--rounds, --steps-per-round, --warmup and --world must be >= 1")
    model = GPTConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=4, d_model=256)
    setup = Setup(model, args.batch, 1, args.warmup, 25.0, 1,
                  tempfile.mkdtemp(prefix="zeroc-bench-"))
    load = os.getloadavg()[0]
    ranks = run_ranks(interleaved_rank, args.world, names, setup, args.rounds,
                      args.steps_per_round, timeout=args.timeout)
    medians = {}
    for name in names:
        wall = [max(step) * 1e3 for step in zip(*(r[name][0] for r in ranks), strict=True)]
        cpu = [max(step) * 1e3 for step in zip(*(r[name][1] for r in ranks), strict=True)]
        medians[name] = (statistics.median(wall), statistics.median(cpu))
        print(f"{name:16s} step median {medians[name][0]:8.1f} ms   CPU {medians[name][1]:7.1f} "
              f"ms   ({len(wall)} steps)")
    for subject, baseline in RATIOS:
        if subject in medians and baseline in medians:
            wall = medians[subject][0] / medians[baseline][0]
            cpu = medians[subject][1] / medians[baseline][1]
            print(f"{subject} / {baseline}: step {wall:.2f}x, CPU {cpu:.2f}x")
    print(f"load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
    return {"medians_ms": medians}


if __name__ == "__main__":
    main()
