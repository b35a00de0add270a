"""The child process of section ``pipeline`` (``gpu_checks/paths.py``).

    cd benchmarks && python -m gpu_checks.pipeline_run --json OUT.json --device cuda:0 ...

Each position of a pp = 2 DualPipeV pipeline (4 micro-batches, ZeRO-3) runs in turn in this
process, as its rank of a world-2 process group of torch's ``fake`` backend whose devices are
this one (``cpu:fake,cuda:fake`` on a GPU, so ``zeroc.runtime.mesh.group_device`` puts the
model there): ``zeroc.parallelize(model, zero=3, pp=2)``, ``torch.compile(backend="zeroc")``
and ``--steps`` training steps (forward, ``backward()``, AdamW), with zeroc's
``count_host_syncs`` over steps 3-5, which follow each other without a synchronize as a job's
steps do (``step_s``: each call's host seconds, so theirs is the time to queue them; the
other steps start on an idle device). The stage programs this position holds compile and run on
the device as in a job; no transfer moves data (the fake backend leaves a receive's buffer as
it was and hands a collective this rank's own data), so losses and gradients are not a
model's and are recorded only as they come. The group is destroyed and Dynamo reset between
the positions. The JSON: ``{"device", "schedule", "pp", "steps", "positions": [{"position",
"stages", "step_s", "losses", "syncs": {step: [{"what", "site"}]}, "measured_groups",
"error"}]}``; an exception in one position is recorded there and the next still runs. In
bf16 the parameters are ``zeroc.MixedPrecision``'s or fp32 under autocast (``--precision``, the
parent's ``--zero3-precision``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
from models.gpt import GPT, GPTConfig, random_token_batch

from . import flops
from .probe import SYNC_STEPS
from .runner import plain

PP, SCHEDULE, MICROBATCHES = 2, "dualpipev", 4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The child's options (the parent passes every one)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--json", required=True, help="where to write the result")
    add("--device", default="cpu", help="cuda:0 or cpu")
    add("--dtype", default="float32", choices=("float32", "bfloat16"))
    add("--precision", default="mixed", choices=("mixed", "autocast"),
        help="bf16: zeroc.MixedPrecision(param_dtype) or fp32 parameters under autocast")
    for name in ("d-model", "n-layer", "n-head", "seq", "vocab", "batch", "steps"):
        add(f"--{name}", type=int, required=True)
    add("--cache-dir", required=True, help="zeroc's cache directory goes under it")
    return parser.parse_args(argv)


def run_position(args: argparse.Namespace, position: int) -> dict[str, Any]:
    """Train ``position``'s stages for ``args.steps`` steps; its record."""
    import zeroc
    from zeroc.runtime.torch_compat import FakeStore  # importing it registers "fake"
    from zeroc.world.host_syncs import count_host_syncs

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    record: dict[str, Any] = {"position": position, "stages": [], "step_s": [], "losses": [],
                              "syncs": {}, "measured_groups": 0, "error": None}
    backend = "cpu:fake,cuda:fake" if device.type == "cuda" else "cpu:fake"
    dist.init_process_group(backend, store=FakeStore(), rank=position, world_size=PP)
    try:
        cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer,
                        n_head=args.n_head, d_model=args.d_model)
        model = GPT(cfg, seed=0).to(device)
        policy, amp = None, lambda: flops.autocast(args.device, dtype)
        if dtype != torch.float32 and args.precision == "mixed":
            policy, amp = zeroc.MixedPrecision(param_dtype=dtype), contextlib.nullcontext
        zeroc.parallelize(model, zero=3, pp=PP, mixed_precision=policy)
        compiled = torch.compile(model, backend="zeroc", options={
            "schedule": SCHEDULE, "microbatches": MICROBATCHES,
            "cache_dir": os.path.join(args.cache_dir, "zeroc")})
        tokens, targets = (t.to(device) for t in random_token_batch(
            cfg.vocab_size, cfg.block_size, args.batch, None, 0))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        losses = []
        for step in range(args.steps):
            if not (step in SYNC_STEPS and step - 1 in SYNC_STEPS):
                _synchronize(device)  # the counted steps follow each other unsynchronized
            start = time.perf_counter()
            with count_host_syncs() as syncs:
                with amp():
                    loss = compiled(tokens, targets)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            record["step_s"].append(time.perf_counter() - start)
            losses.append(loss.detach())
            if step in SYNC_STEPS:
                record["syncs"][str(step)] = [s._asdict() for s in syncs]
            print(f"pipeline_run: position {position} step {step}: "
                  f"{record['step_s'][-1]:.3f} s on the host", file=sys.stderr, flush=True)
        record["losses"] = [float(v.float()) for v in losses]  # read after the counted steps
        plan = zeroc.explain(compiled)
        if plan.pipeline is not None:
            record["stages"] = [s for s, ranks in enumerate(plan.pipeline.placement)
                                if position in ranks]
            times = plan.pipeline.event_times
            record["measured_groups"] = len(times[position]) if len(times) > position else 0
    except Exception as error:  # recorded; the next position still runs
        record["error"] = f"{type(error).__name__}: {error}"
        record["traceback"] = traceback.format_exc()
        print(record["traceback"], file=sys.stderr, flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.compiler.reset()
    return record


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    """Run every position, write the JSON; 0 when each ran every step."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    result = {"device": str(device), "schedule": SCHEDULE, "pp": PP, "steps": args.steps,
              "microbatches": MICROBATCHES, "dtype": args.dtype,
              "positions": [run_position(args, p) for p in range(PP)]}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump(plain(result), handle, indent=1, allow_nan=False)
    return 0 if not any(p["error"] for p in result["positions"]) else 1


if __name__ == "__main__":
    sys.exit(main())
