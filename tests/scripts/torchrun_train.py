"""A user's training script, launched by torchrun: pp=2 x dp ZeRO-3 next to eager.

``torchrun [--nnodes N --node-rank R --rdzv-backend c10d --rdzv-endpoint HOST:PORT]
--nproc-per-node P tests/scripts/torchrun_train.py OUT.json [--steps S]`` initializes the
process group from torchrun's environment (gloo on CPU), builds the zoo GPT (tiny config, the
same seed on every rank), ``zeroc.parallelize(model, zero=3, pp=2)`` (dp = world / 2),
compiles it with ``backend="zeroc"`` and a 1F1B schedule, and trains a few AdamW steps on
seeded global batches, each data-parallel replica passing its rows
(``zeroc.data_parallel_rank``). Global rank 0 trains a plain copy of the model eagerly on the
whole global batch and writes ``OUT.json``: both losses per step (zeroc's is the mean over
the data-parallel replicas, as DDP and FSDP report it), every parameter's largest difference
from eager after the last step (``zeroc.full_state_dict``), whether each is within the parity
tolerance of ``tests/parity.py``, and what every rank saw of torchrun's environment (rank,
local rank, node, mesh position).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

import zeroc

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS_DIR)

from models.gpt import GPT, GPTConfig  # noqa: E402  (the zoo lives in tests/)
from parity import ADAM, RTOL, train_losses  # noqa: E402

PP = 2
GLOBAL_BATCH = 8
MICROBATCHES = 4
MODEL_SEED = 5
DATA_SEED = 7


def global_batches(steps: int, cfg: GPTConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same seeded ``(inputs, targets)`` global batches on every rank."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    tokens = torch.randint(0, cfg.vocab_size, (steps, GLOBAL_BATCH, cfg.block_size + 1),
                           generator=generator)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def eager_losses(model: torch.nn.Module, batches: list) -> list[float]:
    """Plain single-process training of ``model`` on the global batches."""
    return train_losses(model, model, batches)


def parameter_diffs(eager: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> dict:
    """Per parameter: the largest absolute difference and whether it is within the parity
    tolerance (``rtol`` 1e-5, ``atol`` 1e-5 of the tensor's largest magnitude, at least 1)."""
    out = {}
    for name, expected in eager.items():
        actual = full.get(name)
        if actual is None or actual.shape != expected.shape:
            out[name] = {"max_abs_diff": None, "ok": False,
                         "why": "missing" if actual is None else f"shape {list(actual.shape)}"}
            continue
        diff = (actual.float() - expected.float()).abs()
        atol = RTOL * max(1.0, expected.abs().max().item())
        bound = atol + RTOL * expected.abs()
        out[name] = {"max_abs_diff": diff.max().item(), "ok": bool((diff <= bound).all())}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON file global rank 0 writes the comparison to")
    parser.add_argument("--steps", type=int, default=2, help="AdamW steps (default 2)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()

    cfg = GPTConfig.tiny()
    model = GPT(cfg, seed=MODEL_SEED)  # the same parameters on every rank
    reference = copy.deepcopy(model) if rank == 0 else None
    zeroc.parallelize(model, zero=3, pp=PP)
    compiled = torch.compile(model, backend="zeroc",
                             options={"schedule": "1f1b", "microbatches": MICROBATCHES})
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    dp, dp_rank = zeroc.data_parallel_size(model), zeroc.data_parallel_rank(model)
    per = GLOBAL_BATCH // dp
    batches = global_batches(args.steps, cfg)

    losses = []
    for x, y in batches:
        loss = compiled(x[dp_rank * per:(dp_rank + 1) * per],
                        y[dp_rank * per:(dp_rank + 1) * per])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every rank holds its replica's loss: the mean over ranks
        losses.append(mean.item() / world)

    full = zeroc.full_state_dict(model)  # collective; the dict on rank 0 only
    layout = model._zeroc_layout.mesh
    seen = {"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]),
            "group_rank": int(os.environ.get("GROUP_RANK", "-1")),
            "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]), "host": socket.gethostname(),
            "pid": os.getpid(), "dp_rank": dp_rank, "pp_index": layout.pp_index,
            "dp_group_ranks": list(layout.dp_group_ranks)}
    every = [None] * world
    dist.all_gather_object(every, seen)
    if rank == 0:
        expected = eager_losses(reference, batches)
        diffs = parameter_diffs(reference.state_dict(), full)
        result = {"world": world, "dp": dp, "pp": PP, "steps": args.steps,
                  "zeroc_losses": losses, "eager_losses": expected,
                  "max_param_diff": max(float("inf") if d["max_abs_diff"] is None
                                        else d["max_abs_diff"] for d in diffs.values()),
                  "params_ok": all(d["ok"] for d in diffs.values()),
                  "param_diffs": diffs, "ranks": every}
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
