"""First-step (compile) time of distributed zeroc against torch's own distributed + aot_eager.

Two pairs, each on ``--world`` gloo ranks (2 by default; one thread each), the zoo GPT (4
blocks, width 256, 4 heads, vocab 2048, sequence 128 by default):

- ZeRO-3: ``zeroc_zero3`` is ``zeroc.parallelize(model, zero=3)`` + ``torch.compile(model,
  backend="zeroc")``; ``fsdp2_aot_eager`` is ``fully_shard`` on every block and the root, then
  ``torch.compile(model, backend="aot_eager")``. Batch 8 per rank.
- pp=2 DualPipeV: ``zeroc_dualpipev`` is ``zeroc.parallelize(model, zero=0, pp=world)`` +
  ``torch.compile(backend="zeroc", options={"schedule": "dualpipev", ...})``, the split pinned
  to one block per stage; ``torch_dualpipev_aot_eager`` is the same GPT cut by hand into stage
  modules (``benchmarks/pipeline_vs_torch.py``), each compiled in place with
  ``module.compile(backend="aot_eager")`` (``ScheduleDualPipeV`` refuses ``torch.compile``'s
  wrappers; its I/W split needs ``torch._functorch.config.donated_buffer = False``), run by
  ``torch.distributed.pipelining.ScheduleDualPipeV``. Global batch 16 in 8 micro-batches.

*First step* is the wall time of the first training step (forward, backward, AdamW step) in
fresh ranks after ``torch._dynamo.reset()``: Dynamo, the backend's compile and the step. The
slower rank counts. *Second step* shows what the step alone costs. Every configuration runs in
its own fresh ranks, ``--repeats`` times round-robin; the table gives the median over repeats
and the ratio of medians. Each backend first compiles a tiny unrelated function so one-time
imports are not charged to the first compile.

    python benchmarks/compile_distributed.py --repeats 3 --json compile_distributed.json
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
from typing import Any

import torch
import torch.distributed as dist
from tabulate import tabulate

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.normpath(os.path.join(HERE, "..", "tests")))
from models.gpt import GPT, GPTConfig, random_token_batch  # noqa: E402
from pipeline_vs_torch import Setup, StageModule, cross_entropy, untied_gpt  # noqa: E402

PAIRS = (("zeroc_zero3", "fsdp2_aot_eager"), ("zeroc_dualpipev", "torch_dualpipev_aot_eager"))
CONFIGS = tuple(name for pair in PAIRS for name in pair)


def _warm_up(backend: str) -> None:
    """Compile a toy function so imports and one-time setup are not timed."""
    torch.compiler.reset()
    torch.compile(lambda x: (x * 2).sum(), backend=backend)(torch.ones(4, requires_grad=True))
    torch.compiler.reset()


def _zero3(setup: Setup, name: str):
    import zeroc

    torch.compiler.reset()
    model = GPT(setup.model, seed=0)
    if name == "zeroc_zero3":
        model = zeroc.parallelize(model, zero=3)
        compiled = torch.compile(model, backend="zeroc", options={"cache_dir": setup.cache_dir})
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        compiled = torch.compile(model, backend="aot_eager")

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        compiled(x, y).backward()

    return model, step


def _dualpipev(setup: Setup, name: str, rank: int, world: int):
    import zeroc

    torch.compiler.reset()
    stages = 2 * world
    if name == "zeroc_dualpipev":
        per = setup.model.n_layer // stages
        model = zeroc.parallelize(untied_gpt(setup.model), zero=0, pp=world)
        compiled = torch.compile(model, backend="zeroc", options={
            "schedule": "dualpipev", "microbatches": setup.microbatches,
            "split_points": [f"layers.{s * per}" for s in range(1, stages)],
            "cache_dir": setup.cache_dir})

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            compiled(x, y).backward()

        return model, step
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

    mine = [rank, stages - 1 - rank]
    gpt = untied_gpt(setup.model)
    modules = [StageModule(gpt, s, stages) for s in mine]
    # The I/W split runs each stage's backward twice (retain_graph), which AOTAutograd's
    # donated buffers forbid; and ScheduleDualPipeV refuses OptimizedModule wrappers, so the
    # modules compile in place.
    torch._functorch.config.donated_buffer = False
    for module in modules:
        module.compile(backend="aot_eager")
    runner = ScheduleDualPipeV(
        [PipelineStage(m, s, stages, torch.device("cpu"))
         for m, s in zip(modules, mine, strict=True)],
        setup.microbatches, loss_fn=cross_entropy)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        runner.step(x, target=y, losses=[])

    return torch.nn.ModuleList(modules), step


def first_steps(rank: int, world: int, name: str, setup: Setup) -> dict[str, float]:
    """This rank's first and second training-step wall times for configuration ``name``."""
    _warm_up("zeroc" if name.startswith("zeroc") else "aot_eager")
    batch = setup.batch if "zero3" in name else setup.batch * 2
    cfg = setup.model
    # ZeRO-3: a batch per rank; a pipeline: the same batch on both of its ranks.
    seed = rank if "zero3" in name else 0
    x, y = random_token_batch(cfg.vocab_size, cfg.block_size, batch, None, seed=seed)
    dist.barrier()
    started = time.perf_counter()
    if "zero3" in name:
        model, step = _zero3(setup, name)
    else:
        model, step = _dualpipev(setup, name, rank, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    times = []
    for _ in range(2):
        step(x, y)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - started)
        started = time.perf_counter()
    return {"first_s": times[0], "second_s": times[1]}


def measure(name: str, setup: Setup, world: int, timeout: float) -> dict[str, float]:
    """The slower rank's first and second step of ``name`` in fresh ranks."""
    from zeroc.cli.launch import run_ranks

    ranks = run_ranks(first_steps, world, name, setup, timeout=timeout)
    return {key: max(r[key] for r in ranks) for key in ("first_s", "second_s")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated subset of {', '.join(CONFIGS)}")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="batch per rank (ZeRO-3); the "
                        "pipeline's global batch is twice this")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    if args.n_layer % (2 * args.world):
        parser.error(f"--n-layer {args.n_layer} must divide into {2 * args.world} stages")
    model = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer,
                      n_head=4, d_model=args.d_model)
    setup = Setup(model=model, batch=args.batch, microbatches=8, steps=0, warmup=0,
                  cache_dir=tempfile.mkdtemp(prefix="zeroc-compile-dist-"))
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    for repeat in range(args.repeats):
        for name in configs:
            runs[name].append(measure(name, setup, args.world, args.timeout))
            print(f"repeat {repeat + 1}/{args.repeats} {name}: first step "
                  f"{runs[name][-1]['first_s']:.2f} s", flush=True)
    medians = {c: {k: statistics.median(r[k] for r in runs[c]) for k in ("first_s", "second_s")}
               for c in configs}
    rows = [[c, f"{medians[c]['first_s']:.2f}",
             " / ".join(f"{r['first_s']:.2f}" for r in runs[c]),
             f"{medians[c]['second_s']:.3f}"] for c in configs]
    print(f"\n{datetime.date.today()}, torch {torch.__version__}, Python "
          f"{platform.python_version()}, {os.cpu_count()} CPUs, world {args.world}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(tabulate(rows, headers=["config", "first step (s)", "per repeat", "second step (s)"]))
    ratios = {}
    for ours, theirs in PAIRS:
        if ours in medians and theirs in medians:
            ratios[f"{ours}/{theirs}"] = medians[ours]["first_s"] / medians[theirs]["first_s"]
    print(tabulate([[k, f"{v:.2f}x"] for k, v in ratios.items()],
                   headers=["ratio", "first step (median)"]))
    result = {"world": args.world, "runs": runs, "medians": medians, "ratios": ratios,
              "torch": torch.__version__, "date": str(datetime.date.today())}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return result


if __name__ == "__main__":
    main()
