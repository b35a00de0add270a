"""Quantized ZeRO collectives: bytes moved, step time and training quality.

ZeRO-3 on gloo ranks (one thread each), the same model and batches in every configuration:

- ``exact``: ``zeroc.parallelize(model, zero=3)``, ``torch.compile(backend="zeroc")``.
- ``gather8``: ``options={"gather_quant": "int8"}`` (ZeRO++'s qwZ).
- ``gather8_reduce8``: and ``"reduce_quant": "int8"`` (qgZ, with error feedback).
- ``gather8_reduce4``: and ``"reduce_quant": "int4"``.

Models (``--model``): the zoo GPT (width 256, 4 layers, vocab 4096, sequence 128: 4.2M
parameters) or an HF ``LlamaForCausalLM`` of the same width, layers and vocabulary (a user's
wrapper returns ``.loss``). Per configuration: the median step (slowest rank), the bytes one
rank moves per step as the plan counts them (``mb_moved_per_step``; all ranks together:
``mb_moved_per_step_total``, what a shared link carries), their ratio to ``exact``, and the
last loss. ``--repeats`` interleaves the configurations; medians are reported. The JSON has
``results`` in ``pipeline_vs_torch.py``'s form, so ``slow_link.py`` can run it on slow links:

    python benchmarks/slow_link.py --rates plain,1gbit --repeats 3 --baseline exact -- \\
        python benchmarks/quantized_collectives.py --world 2 --repeats 1 --json {json}

``--cross-node WORLD:PER_NODE`` instead plans ZeRO-3 for WORLD GPUs in nodes of PER_NODE
(``zeroc.explain(world=...)``, fake CUDA, nothing run for real) in ``exact``, ``hpz`` (hpZ:
``secondary_shard=PER_NODE``), ``gather8_reduce4`` and ``gather8_reduce4_hpz``, and prints the
bytes one rank sends per step over groups that span nodes (the data-parallel group) and over
groups inside a node (hpZ's), as the plan counts them. The slow-link tool shapes one link for
every rank, so a node boundary cannot be timed here: these are counts.

``--quality STEPS`` instead trains the model for STEPS steps on a task it can learn, in each
of ``--quality-configs`` (default ``exact``, ``reduce8``, ``reduce4``, ``gather8_reduce4``) on
the same batches, at each learning rate of ``--lrs``, and prints for each the training loss at
the end (the mean of the last 20 steps), the loss on held-out batches after the last step,
and their gaps to ``exact``. ``--task counting``: each sequence counts up from a random token
by a stride drawn from 1-4 (the next token is predictable after two); ``--task markov``: a
fixed random first-order Markov chain whose rows put most of their mass on a few tokens (the
loss cannot fall below the chain's entropy, as on real text).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                 "tests")))
from models.gpt import GPT, GPTConfig, random_token_batch  # noqa: E402

from zeroc.cli.launch import run_ranks  # noqa: E402

CONFIGS = {
    "exact": {},
    "gather8": {"gather_quant": "int8"},
    "gather8_reduce8": {"gather_quant": "int8", "reduce_quant": "int8"},
    "gather8_reduce4": {"gather_quant": "int8", "reduce_quant": "int4"},
    "reduce8": {"reduce_quant": "int8"},
    "reduce4": {"reduce_quant": "int4"},
}
QUALITY_CONFIGS = ("exact", "reduce8", "reduce4", "gather8_reduce4")
TASKS = ("counting", "markov")
HELD_OUT_BATCHES = 8
MODELS = ("gpt", "llama")
CROSS_NODE_CONFIGS = ("exact", "hpz", "gather8_reduce4", "gather8_reduce4_hpz")


class LossOf(torch.nn.Module):
    """A user's wrapper of an HF causal LM: ``forward(tokens, targets)`` returns the loss."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=tokens).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_model(name: str, width: int, layers: int, vocab: int, seq: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=4,
                             d_model=width), seed=0)
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=width, intermediate_size=int(width * 8 / 3), num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=vocab,
        max_position_embeddings=seq, tie_word_embeddings=False)
    return LossOf(transformers.LlamaForCausalLM(config))


def counting_batch(vocab: int, seq: int, batch: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Sequences that count up from a random token by a random stride (1-4), modulo vocab."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 5, (batch, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def markov_batch(vocab: int, seq: int, batch: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Sequences of a fixed first-order Markov chain (the same chain for every seed): each
    token's row of the transition matrix puts most of its mass on four tokens."""
    chain = torch.Generator().manual_seed(12345)
    logits = torch.randn(vocab, vocab, generator=chain)
    favourites = torch.randint(0, vocab, (vocab, 4), generator=chain)
    logits.scatter_add_(1, favourites, torch.full((vocab, 4), 4.0))
    probs = torch.softmax(logits, dim=1)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=generator)
    for t in range(seq):
        tokens[:, t + 1] = torch.multinomial(probs[tokens[:, t]], 1, generator=generator)[:, 0]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def task_batch(task: str, args: argparse.Namespace, seed: int) -> tuple[torch.Tensor, ...]:
    make = counting_batch if task == "counting" else markov_batch
    return make(args.vocab, args.seq, args.batch, seed)


def train_rank(rank: int, world: int, config: str, args: argparse.Namespace) -> dict[str, Any]:
    import zeroc

    torch.compiler.reset()
    model = zeroc.parallelize(build_model(args.model, args.width, args.layers, args.vocab,
                                          args.seq), zero=3)
    compiled = torch.compile(model, backend="zeroc", options=CONFIGS[config])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    steps = args.quality or args.warmup + args.steps
    times, losses = [], []
    for step in range(steps):
        if args.quality:
            tokens, targets = task_batch(args.task, args, 1000 * step + rank)
        else:
            tokens, targets = random_token_batch(args.vocab, args.seq, args.batch, None,
                                                 seed=1 + rank)
        dist.barrier()
        begin = time.perf_counter()
        loss = compiled(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - begin
        if step >= args.warmup:
            times.append(elapsed)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    moved = sum(c.bytes for c in zeroc.explain(compiled).collectives)
    held_out = None
    if args.quality:  # batches no step trained on (seeds past every training seed)
        model.eval()
        total = torch.zeros(())
        with torch.no_grad():
            for index in range(HELD_OUT_BATCHES):
                tokens, targets = task_batch(args.task, args, 10**7 + 100 * index + rank)
                total += compiled(tokens, targets).detach()
        dist.all_reduce(total)
        held_out = total.item() / (world * HELD_OUT_BATCHES)
    return {"step_ms": statistics.median(times) * 1000 if times else None,
            "losses": losses, "bytes": moved, "held_out": held_out}


def run_quality(args: argparse.Namespace) -> dict[str, Any]:
    configs = args.quality_configs.split(",")
    rows, out = [], {}
    for lr in (float(v) for v in args.lrs.split(",")):
        ends, held = {}, {}
        for config in configs:
            ranks = run_ranks(train_rank, args.world, config, argparse.Namespace(
                **{**vars(args), "lr": lr}), timeout=args.timeout)
            losses = ranks[0]["losses"]
            ends[config] = statistics.fmean(losses[-20:])
            held[config] = ranks[0]["held_out"]
            out[f"{args.task} lr={lr:g} {config}"] = {
                "start": losses[0], "end_mean_last_20": ends[config],
                "held_out": held[config], "losses": losses}
        for config in configs:
            train_gap = ends[config] / ends["exact"] - 1
            held_gap = held[config] / held["exact"] - 1
            out[f"{args.task} lr={lr:g} {config}"].update(train_gap=train_gap,
                                                           held_out_gap=held_gap)
            rows.append([args.task, f"{lr:g}", config, f"{ends[config]:.4f}",
                         f"{100 * train_gap:+.2f}%", f"{held[config]:.4f}",
                         f"{100 * held_gap:+.2f}%"])
    print(tabulate(rows, headers=["task", "lr", "config",
                                  f"train loss, mean of steps {args.quality - 19}-{args.quality}",
                                  "vs exact", "held-out loss", "vs exact"],
                   disable_numparse=True))
    return {"quality": out, "steps": args.quality, "task": args.task}


def run_cross_node(args: argparse.Namespace) -> dict[str, Any]:
    import zeroc

    world, per_node = (int(v) for v in args.cross_node.split(":"))
    model = build_model(args.model, args.width, args.layers, args.vocab, args.seq)
    batch = random_token_batch(args.vocab, args.seq, args.batch, None, seed=1)  # per rank
    results, rows = {}, []
    for config in CROSS_NODE_CONFIGS:
        options = dict(CONFIGS[config.removesuffix("_hpz").replace("hpz", "exact")])
        if config.endswith("hpz"):
            options["secondary_shard"] = per_node
        plan = zeroc.explain(model, batch, world=world, zero=3, device="cuda", options=options)
        spans = sum(c.bytes for c in plan.collectives if c.mesh_dim == "dp") / 1e6
        inside = sum(c.bytes for c in plan.collectives if c.mesh_dim == "node") / 1e6
        results[config] = {"mb_across_nodes": spans, "mb_inside_node": inside,
                           "activations_mb": plan.memory[0].activations / 1e6}
        exact = results["exact"]["mb_across_nodes"]
        rows.append([config, f"{spans:.2f}", f"{inside:.2f}", f"{exact / spans:.2f}x",
                     f"{plan.memory[0].activations / 1e6:.1f}"])
    print(tabulate(rows, headers=["config", "MB across nodes per rank per step",
                                  "MB inside a node", "fewer across than exact",
                                  "activations MB"], disable_numparse=True))
    return {"cross_node": results, "world": world, "per_node": per_node}


def run_speed(args: argparse.Namespace) -> dict[str, Any]:
    configs = args.configs.split(",")
    measured: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for repeat in range(args.repeats):
        for config in configs:
            ranks = run_ranks(train_rank, args.world, config, args, timeout=args.timeout)
            measured[config].append({"step_ms": max(r["step_ms"] for r in ranks),
                                     "bytes": max(r["bytes"] for r in ranks),
                                     "loss": ranks[0]["losses"][-1]})
            print(f"[repeat {repeat + 1}] {config}: {measured[config][-1]['step_ms']:.1f} ms",
                  file=sys.stderr, flush=True)
    results, rows = {}, []
    exact_mb = None
    for config in configs:
        step = statistics.median(m["step_ms"] for m in measured[config])
        mb = measured[config][0]["bytes"] / 1e6
        exact_mb = mb if config == "exact" else exact_mb
        results[config] = {"step_median_ms": step, "mb_moved_per_step": mb,
                           "mb_moved_per_step_total": mb * args.world,
                           "step_ms_per_repeat": [m["step_ms"] for m in measured[config]],
                           "loss_last": measured[config][-1]["loss"]}
        fewer = f"{exact_mb / mb:.2f}x" if exact_mb else "n/a"
        rows.append([config, f"{step:.1f}", f"{mb:.3f}", fewer,
                     f"{measured[config][-1]['loss']:.5f}"])
    print(tabulate(rows, headers=["config", "step ms (median)", "MB moved per rank per step",
                                  "fewer bytes than exact", "loss last"],
                   disable_numparse=True))
    return {"results": results}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", choices=MODELS, default="gpt")
    add("--world", type=int, default=2, help="data-parallel gloo ranks")
    add("--width", type=int, default=256)
    add("--layers", type=int, default=4)
    add("--vocab", type=int, default=4096)
    add("--seq", type=int, default=128)
    add("--batch", type=int, default=8, help="sequences per rank")
    add("--lr", type=float, default=3e-4)
    add("--steps", type=int, default=10, help="timed steps")
    add("--warmup", type=int, default=3, help="discarded steps before them")
    add("--repeats", type=int, default=3)
    add("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    add("--quality", type=int, default=0, metavar="STEPS",
        help="train --task for STEPS steps instead of timing")
    add("--task", choices=TASKS, default="counting", help="--quality's task")
    add("--lrs", default="1e-3", help="--quality: comma-separated learning rates")
    add("--quality-configs", default=",".join(QUALITY_CONFIGS),
        help="--quality: comma-separated configurations (exact first)")
    add("--cross-node", metavar="WORLD:PER_NODE",
        help="plan ZeRO-3 for WORLD GPUs in nodes of PER_NODE and count cross-node bytes")
    add("--timeout", type=float, default=1800, help="seconds per configuration run")
    add("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: {unknown} not known; known: {list(CONFIGS)}")
    if args.quality:
        args.warmup = 0
        chosen = args.quality_configs.split(",")
        if chosen[0] != "exact" or any(c not in CONFIGS for c in chosen):
            parser.error(f"--quality-configs: {chosen}: start with exact, then any of "
                         f"{list(CONFIGS)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    payload = (run_cross_node(args) if args.cross_node else
               run_quality(args) if args.quality else run_speed(args))
    payload["args"] = vars(args)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)
    return payload


if __name__ == "__main__":
    main()
