"""How long ``zeroc.explain(model, inputs, world=...)`` takes to plan large jobs on this CPU.

Two Llama-shaped models from Hugging Face configs, built on the meta device:

- 7B: 32 layers, d_model 4096, ffn 11008, 32 heads, vocab 32000, at world 64 = pp 8 x dp 8;
- 70B: 80 layers, d_model 8192, ffn 28672, 64 heads with 8 KV heads, vocab 128256, at world
  1024 = pp 16 x dp 64.

Each is planned with ZeRO-3, 1F1B, one sequence of 2048 tokens per micro-batch; the script
prints the wall time of each plan (and of Dynamo tracing the model alone, for scale) and the
model state the plan gives a rank of the first pipeline position.

    python benchmarks/plan_speed.py [--models 7b,70b] [--device cpu] [--tune] [--json F]

``--tune`` also times ``zeroc.tune(world=..., device="cuda", hardware="h100-sxm")`` on each
model: every candidate layout screened, the best planned in full (``zeroc.tuning.tune_world``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SHAPES = {
    "7b": dict(layers=32, hidden=4096, ffn=11008, heads=32, kv_heads=32, vocab=32000,
               world=64, pp=8),
    "70b": dict(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256,
                world=1024, pp=16),
}


def llama(shape: dict, seq: int):
    """A meta-device ``LlamaForCausalLM`` of ``shape``, returning ``.loss`` with labels."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        intermediate_size=shape["ffn"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=seq, use_cache=False, tie_word_embeddings=False)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def dynamo_trace_seconds(model, inputs: dict) -> float:
    """Seconds for Dynamo alone to trace ``model`` (a backend that keeps the graph)."""
    from zeroc.runtime.torch_compat import FakeTensorMode

    started = time.perf_counter()
    torch.compiler.reset()
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in inputs.items()}
        torch.compile(model, backend=lambda gm, ex: gm.forward)(**fake)
    torch.compiler.reset()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="7b,70b", help="comma-separated subset of 7b,70b")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--tune", action="store_true",
                        help="also time zeroc.tune(world=..., device='cuda', "
                             "hardware='h100-sxm') on each model (target: 7B in 120 s)")
    args = parser.parse_args(argv)
    import zeroc

    results = {}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        shape = SHAPES[name]
        microbatches = 2 * shape["pp"]
        tokens = torch.zeros(microbatches, args.seq, dtype=torch.long)
        inputs = {"input_ids": tokens, "labels": tokens}
        model = llama(shape, args.seq)
        params = sum(p.numel() for p in model.parameters())
        trace_s = dynamo_trace_seconds(model, inputs)
        started = time.perf_counter()
        plan = zeroc.explain(model, inputs, world=shape["world"], pp=shape["pp"], zero=3,
                             device=args.device,
                             options={"schedule": "1f1b", "microbatches": microbatches})
        plan_s = time.perf_counter() - started
        row = plan.memory[0]
        results[name] = {"parameters": params, "world": shape["world"], "pp": shape["pp"],
                         "plan_s": plan_s, "dynamo_trace_s": trace_s,
                         "rank0_model_state_bytes": row.params + row.grads + row.optimizer}
        print(f"{name}: {params / 1e9:.2f}B parameters, world {shape['world']} (pp "
              f"{shape['pp']}): planned in {plan_s:.1f} s (Dynamo trace alone {trace_s:.1f} "
              f"s); rank 0 model state {results[name]['rank0_model_state_bytes'] / 2**30:.2f} "
              "GiB", flush=True)
        if args.tune:
            import tempfile

            started = time.perf_counter()
            with tempfile.TemporaryDirectory() as cache:
                tuned = zeroc.tune(model, inputs, world=shape["world"], device="cuda",
                                   hardware="h100-sxm", cache_dir=cache)
            tune_s = time.perf_counter() - started
            planned = sum(1 for t in tuned.trials if t.estimated_s is not None)
            results[name].update(tune_s=tune_s, tune_candidates=len(tuned.trials),
                                 tune_planned=planned, tune_best=tuned.best.label())
            print(f"{name}: tuned for world {shape['world']} in {tune_s:.1f} s "
                  f"({len(tuned.trials)} candidates screened, {planned} planned): "
                  f"{tuned.why()}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return results


if __name__ == "__main__":
    main()
