"""How well ``zeroc.tune``'s estimates rank and size the real step, on 2 and 4 gloo ranks.

For each world size, every rank builds the zoo GPT (tests/models/gpt.py) and the same candidates
(at least 8: ZeRO stages, pipelines, the memory trades); rank 0 estimates each in the fake world
on this machine's calibrated profile (``zeroc.calibrate``; ``--calibration-dir`` for a run under
``slowlink``, whose link the cached profile of the plain loopback does not know), as
``zeroc.tune`` does, and then *every* candidate is measured for real (``--repeats`` rounds,
round-robin, median). Printed per world: the table, Spearman's rank correlation between
estimated and measured step, the median absolute error of the estimate, how far the tuner's pick
(best ``--measure`` by estimate, then measured) is from the best measured candidate, and the
tuned layout's step over the default layout's (ZeRO-3, pp=1, default options).

    python benchmarks/tune_accuracy.py --worlds 2,4 --json tune_accuracy.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                 "tests")))
from models.gpt import GPT, GPTConfig  # noqa: E402

from zeroc.cli.launch import run_ranks  # noqa: E402
from zeroc.tuning.tune_result import spearman  # noqa: E402


def _model(args: argparse.Namespace) -> GPT:
    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                       n_head=4, d_model=args.d_model)
    return GPT(config, seed=0)


SEARCH = {"fused_loss": [True, False], "partitioner": ["min_cut", "default"], "zero": [3, 2, 0],
          "prefetch": [1], "schedule": ["1f1b", "dualpipev"], "pp": [1, 2]}


def pick(space: list, limit: int) -> list:
    """A spread of the space, defaults first: every pp=1 ZeRO stage with the default
    partitioner and both fused-loss settings, ZeRO-3 with min_cut, and each pipeline
    schedule (its first data-parallel ZeRO stage, the fused loss, the default partitioner)."""
    chosen = [c for c in space if c.pp == 1 and c.options_dict()["partitioner"] == "default"]
    chosen += [c for c in space if c.pp == 1 and c.zero == 3
               and c.options_dict()["partitioner"] == "min_cut"]
    seen = set()
    for c in space:
        o = c.options_dict()
        key = (o.get("schedule"), o.get("microbatches"))
        if c.pp > 1 and key not in seen and o["fused_loss"] and o["partitioner"] == "default":
            seen.add(key)
            chosen.append(c)
    return list(dict.fromkeys([space[0], *chosen]))[:limit]


def _measure_world(rank: int, world: int, args: argparse.Namespace) -> dict | None:
    """One gloo rank (``zeroc.cli.launch.run_ranks``): rank 0 returns the world's rows."""
    import zeroc
    from zeroc.tuning.tune import measure
    from zeroc.tuning.tune_estimate import estimate_all
    from zeroc.tuning.tune_space import candidates

    model = _model(args)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq),
                           generator=torch.Generator().manual_seed(0))
    inputs = (tokens, tokens)
    profile = zeroc.calibrate(cache_dir=args.calibration_dir)
    space = pick(candidates(world, args.batch, SEARCH), args.candidates)
    estimates = estimate_all(model, inputs, space, world=world, device="cpu",
                             hardware=profile, budget_s=args.estimate_budget)
    runnable = [c for c in space if estimates.get(c, (None,))[0] is not None]
    times: dict = {c: [] for c in runnable}
    for _ in range(args.repeats):
        for candidate in runnable:
            times[candidate].append(measure(model, inputs, candidate, args.steps))
    if rank != 0:
        return None
    rows = [{"candidate": c.label(), "estimated_s": estimates[c][0],
             "peak_bytes": estimates[c][1],
             "measured_s": statistics.median(times[c])} for c in runnable]
    return {"world": world, "rows": rows,
            "rejected": {c.label(): estimates[c][2] for c in space if c not in runnable}}


def summarize(world: int, rows: list[dict], measure_best: int) -> dict:
    """The accuracy figures of one world's rows."""
    est = [r["estimated_s"] for r in rows]
    meas = [r["measured_s"] for r in rows]
    errors = [abs(e - m) / m for e, m in zip(est, meas, strict=True)]
    by_estimate = sorted(rows, key=lambda r: r["estimated_s"])[:measure_best]
    tuned = min(by_estimate, key=lambda r: r["measured_s"])
    best = min(rows, key=lambda r: r["measured_s"])
    default = rows[0]  # candidates() lists the defaults first
    return {"world": world, "candidates": len(rows), "spearman": spearman(est, meas),
            "median_abs_error": statistics.median(errors),
            "tuned": tuned["candidate"], "best": best["candidate"],
            "tuned_over_best": tuned["measured_s"] / best["measured_s"],
            "tuned_over_default": tuned["measured_s"] / default["measured_s"]}


def main(argv: list[str] | None = None) -> int:
    """Run every world, print the tables and figures; 0 when every world ran."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--candidates", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--measure", type=int, default=3)
    parser.add_argument("--estimate-budget", type=float, default=600.0)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--calibration-dir", default=None,
                        help="zeroc.calibrate's cache_dir (default ~/.cache/zeroc); give a "
                             "run on another link (slowlink) a directory of its own, since "
                             "the calibration's key names the machine, not its network")
    parser.add_argument("--timeout", type=float, default=7200.0,
                        help="seconds a world may take before its ranks are stopped")
    args = parser.parse_args(argv)
    from tabulate import tabulate

    results = []
    for world in (int(w) for w in args.worlds.split(",")):
        data = run_ranks(_measure_world, world, args, timeout=args.timeout)[0]
        summary = summarize(world, data["rows"], args.measure)
        results.append({**data, "summary": summary})
        print(f"\nworld {world}: {summary['candidates']} candidates")
        print(tabulate([[r["candidate"], f"{r['estimated_s'] * 1e3:.3g}",
                         f"{r['measured_s'] * 1e3:.3g}"] for r in data["rows"]],
                       headers=["candidate", "estimated (ms)", "measured (ms)"]))
        print(f"Spearman {summary['spearman']:.2f}, median abs error "
              f"{summary['median_abs_error']:.0%}, tuned/best {summary['tuned_over_best']:.2f}x,"
              f" tuned/default {summary['tuned_over_default']:.2f}x (tuned: {summary['tuned']})")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
