"""How well the tuner's screen ranks layouts against full plans of the same layouts.

``zeroc.tune(world=W)`` screens every candidate on one profiled fake step
(``zeroc.tuning.tune_screen``) and plans only the screen's best. This script screens and fully plans
(``zeroc.explain(world=...)`` on fake tensors) every candidate of a search for a small
Hugging Face Llama on a hardware profile, and prints, per candidate, the screened and the
planned step and peak with their ratios, then Spearman's rank correlation of each.

    python benchmarks/screen_accuracy.py [--layers 8] [--hidden 512] [--world 8]
        [--hardware h100-sxm] [--json screen_accuracy.json]

The default search (pp 2 and 4, ZeRO 3 and 0, both schedules, 4 and 8 micro-batches, both
partitioners and loss forms) holds 40 candidates and takes about 15 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plan_speed import llama  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    from zeroc.runtime.cost.hardware import get_profile
    from zeroc.tuning.tune_result import spearman
    from zeroc.tuning.tune_screen import screen
    from zeroc.tuning.tune_space import candidates
    from zeroc.world.model_profile import profile_model
    from zeroc.world.world_plan import plan_world

    shape = dict(layers=args.layers, hidden=args.hidden, ffn=args.hidden * 11 // 4, heads=8,
                 kv_heads=8, vocab=8000)
    tokens = torch.zeros(args.batch, args.seq, dtype=torch.long)
    inputs = {"input_ids": tokens, "labels": tokens}
    model = llama(shape, args.seq)
    hardware = get_profile(args.hardware)
    started = time.perf_counter()
    profile = profile_model(model, inputs, "cuda")  # the device the plans are for
    print(f"profiled in {time.perf_counter() - started:.1f} s", flush=True)
    space = candidates(args.world, args.batch, {"pp": [2, 4], "zero": [3, 0],
                                                "microbatches": [4, 8]})
    rows = []
    for candidate in space:
        screened = screen(profile, candidate, args.world, hardware)
        began = time.perf_counter()
        try:
            plan = plan_world(model, inputs, world=args.world, pp=candidate.pp,
                              zero=candidate.zero, device="cuda", hardware=hardware,
                              options=candidate.options_dict())
        except Exception as error:  # e.g. more stages than layers: the plan refuses
            print(f"{candidate.label()}: cannot plan ({str(error).splitlines()[0][:80]})")
            continue
        planned_s = plan.estimate.step_s
        planned_peak = max(m.peak for m in plan.memory)
        rows.append({"candidate": candidate.label(), "screened_s": screened.step_s,
                     "planned_s": planned_s, "screened_peak": screened.peak_bytes,
                     "planned_peak": planned_peak,
                     "plan_seconds": time.perf_counter() - began})
        print(f"{candidate.label():92s} step {screened.step_s * 1e3:7.2f} / "
              f"{planned_s * 1e3:7.2f} ms = {screened.step_s / planned_s:.2f}   peak "
              f"{screened.peak_bytes / 2**20:6.0f} / {planned_peak / 2**20:6.0f} MiB = "
              f"{screened.peak_bytes / planned_peak:.2f}", flush=True)
    summary = {
        "candidates": len(rows),
        "spearman_step": spearman([r["screened_s"] for r in rows],
                                  [r["planned_s"] for r in rows]),
        "spearman_peak": spearman([r["screened_peak"] for r in rows],
                                  [r["planned_peak"] for r in rows]),
        "step_ratio": [min(r["screened_s"] / r["planned_s"] for r in rows),
                       max(r["screened_s"] / r["planned_s"] for r in rows)],
        "peak_ratio": [min(r["screened_peak"] / r["planned_peak"] for r in rows),
                       max(r["screened_peak"] / r["planned_peak"] for r in rows)],
    }
    print(f"{summary['candidates']} layouts: Spearman step {summary['spearman_step']:.2f}, "
          f"peak {summary['spearman_peak']:.2f}; screened/planned step "
          f"{summary['step_ratio'][0]:.2f}-{summary['step_ratio'][1]:.2f}, peak "
          f"{summary['peak_ratio'][0]:.2f}-{summary['peak_ratio'][1]:.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": rows, "summary": summary}, handle, indent=2)
    return summary


if __name__ == "__main__":
    main()
