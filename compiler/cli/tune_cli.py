"""``python -m zeroc tune FILE.py:FACTORY ...``: tune a model from the command line.

``FACTORY()`` returns ``(model, example_inputs)`` (as for ``python -m zeroc explain``). Three
ways to run:

- ``--nproc N`` (default 1): starts N local ranks itself (``zeroc.cli.local_ranks``, as the demo
  does; gloo on CPU, NCCL on CUDA) and tunes on them;
- under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set): tunes on the world
  torchrun started (NCCL on CUDA);
- ``--world W``: plans a W-rank job from the fake world alone (``--hardware``, ``--device``),
  measuring nothing.

Rank 0 prints the table of candidates, the winner and why; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from zeroc.cli.explain_cli import load_factory
from zeroc.cli.local_ranks import in_torchrun, resolve_device, run_local_ranks, run_torchrun

__all__ = ["run_tune"]

NAME = "zeroc tune"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zeroc tune",
        description="Choose a layout and options for a model: estimate every candidate in the "
                    "fake world, measure the best few on real ranks, cache the winner.")
    parser.add_argument("factory", help="path/to/file.py:function returning (model, "
                        "example_inputs); the model not yet parallelized")
    parser.add_argument("--nproc", type=int, default=1,
                        help="local ranks to start and tune on (gloo on cpu, nccl on cuda); "
                             "ignored under torchrun")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for estimating and measuring (default 300; with "
                             "--world, for screening and planning: default 90)")
    parser.add_argument("--search", default="{}", metavar="JSON",
                        help='axes to narrow or widen, e.g. \'{"zero": [2, 3]}\' (axes: zero, '
                             "pp, schedule, microbatches, bucket_mb, prefetch, fused_loss, "
                             "partitioner)")
    parser.add_argument("--measure", type=int, default=3,
                        help="how many of the best estimates to measure (default 3; with "
                             "--world, at most how many screened candidates to plan in full)")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed training steps per measured candidate (default 5)")
    parser.add_argument("--world", type=int, default=None,
                        help="rank layouts for a job of this many ranks from the fake world "
                             "alone (no measuring): every candidate screened on one profiled "
                             "step, the best planned in full")
    parser.add_argument("--device", default=None, choices=("cpu", "cuda"),
                        help="device to tune for (default: cuda if there is a GPU per local "
                             "rank, else cpu)")
    parser.add_argument("--hardware", default=None,
                        help="hardware profile for the estimates (a100-80gb, h100-sxm, h200; "
                             "default: calibrate this machine)")
    parser.add_argument("--cache-dir", default=None, help="zeroc's cache (default ~/.cache/zeroc)")
    parser.add_argument("--force", action="store_true", help="search even if a result is cached")
    parser.add_argument("--json", metavar="PATH", help="write the winner and the table here")
    return parser


def _tune(args: argparse.Namespace, rank: int) -> int:
    import zeroc

    model, example_inputs = load_factory(args.factory)()
    result = zeroc.tune(model, example_inputs, budget_s=args.budget,
                        search=json.loads(args.search), measure_best=args.measure,
                        steps=args.steps, device=args.device, hardware=args.hardware,
                        cache_dir=args.cache_dir, force=args.force, world=args.world)
    if rank == 0:
        print(result.table())
        print(f"chosen: {result.best.label()}"
              + (" (from the cache)" if result.from_cache else ""))
        print(f"why: {result.why()}")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"best": result.best.to_json(), "measured": result.measured,
                           "trials": [t.to_json() for t in result.trials]}, handle, indent=1)
    return 0


def _tune_rank(rank: int, world: int, args: argparse.Namespace) -> int:
    return _tune(args, rank)


def run_tune(argv: list[str]) -> int:
    """Parse ``argv`` and tune; the exit code."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("zeroc.tuning.tune").setLevel(logging.INFO)
    if args.world is not None:
        return _tune(args, 0)
    if args.nproc < 1:
        print(f"python -m zeroc tune: --nproc={args.nproc} must be >= 1", file=sys.stderr)
        return 2
    ranks_here = (int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
                  if in_torchrun() else args.nproc)
    try:  # the ranks and zeroc.tune measure on one device: the one the ranks are started on
        args.device = resolve_device(args.device, ranks_here)
    except ValueError as error:
        print(f"python -m zeroc tune: {error}", file=sys.stderr)
        return 2
    if in_torchrun():
        return run_torchrun(_tune_rank, args, device=args.device, name=NAME)
    return run_local_ranks(_tune_rank, args.nproc, args, device=args.device, name=NAME)
