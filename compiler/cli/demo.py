"""``python -m zeroc demo``: train the zoo GPT with zeroc and print the plan and the loss.

The demo trains the GPT of the model zoo (``tests/models`` of the source checkout) on random
tokens, step by step, next to an eager copy of the same model, and prints both losses so the
parity is visible, then the plan zeroc compiled.

``--nproc N`` starts N ranks on this machine; under ``torchrun`` (``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK`` set) the demo runs on the world torchrun started instead, rank 0 printing.
``--device`` is ``auto`` (CUDA with NCCL when there is a GPU per local rank, else CPU with
gloo), ``cpu`` or ``cuda``. ``--zero`` and ``--pp`` go to ``zeroc.parallelize``,
``--schedule``/``--microbatches`` to the compile options, e.g.
``python -m zeroc demo --nproc 4 --pp 2 --schedule dualpipev --zero 3`` prints the loss per
step (the mean over data-parallel replicas, next to eager on the global batch) and the plan
with the schedule grid. Ctrl-C stops every rank with one line (exit code 130).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from zeroc.cli.local_ranks import (
    DEVICES,
    backend_for,
    in_torchrun,
    resolve_device,
    run_local_ranks,
    run_torchrun,
)

log = logging.getLogger(__name__)

# The pipeline schedules (zeroc.frontend.config.SCHEDULES); the demo takes the same names.
SCHEDULES = ("gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev")
NAME = "zeroc demo"


def _zoo_path() -> str:
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # compiler/
    tests = os.path.join(os.path.dirname(package), "tests")
    if not os.path.isdir(os.path.join(tests, "models")):
        raise SystemExit(
            "zeroc demo: the model zoo (tests/models) was not found next to the package; run "
            "the demo from a source checkout installed with `pip install -e .`"
        )
    return tests


def build_parser() -> argparse.ArgumentParser:
    """The demo's argument parser (``python -m zeroc demo --help``)."""
    parser = argparse.ArgumentParser(prog="python -m zeroc demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--layers", type=int, default=4, help="GPT blocks (default 4)")
    parser.add_argument("--width", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--lr", type=float, default=3e-3,
                        help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the model's initial weights and the random tokens "
                             "(default 0)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to start on this machine (default 1: no "
                             "torch.distributed); under torchrun, torchrun's world is used")
    parser.add_argument("--device", default="auto", choices=DEVICES,
                        help="auto (default): cuda with nccl when there is a GPU per local "
                             "rank, else cpu with gloo; cpu; cuda (an error without a GPU)")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None,
                        help="ZeRO stage for zeroc.parallelize (default: 3 with more than one "
                             "rank)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages' ranks (default 1)")
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                        help="pipeline schedule with --pp > 1 (default 1f1b)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="micro-batches per step with --pp > 1 (default: zeroc's choice)")
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse and check ``argv``; ``nproc`` becomes torchrun's world under torchrun and
    ``device`` the device the ranks use (``cpu`` or ``cuda``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    local_ranks = args.nproc or 1
    if in_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.nproc is not None and args.nproc != world:
            parser.error(f"--nproc {args.nproc} does not match torchrun's WORLD_SIZE {world}; "
                         "under torchrun the world is torchrun's (leave --nproc out)")
        args.nproc = world
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    elif args.nproc is None:
        args.nproc = 1
    for name in ("steps", "batch", "seq", "layers", "width", "nproc", "pp"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.nproc % args.pp:
        parser.error(f"--pp {args.pp} must divide --nproc {args.nproc}")
    if args.batch % (args.nproc // args.pp):
        parser.error(f"--batch {args.batch} must be a multiple of the data-parallel size "
                     f"{args.nproc // args.pp}")
    if args.zero is None and args.nproc > 1:
        args.zero = 3
    try:
        args.device = resolve_device(args.device, local_ranks)
    except ValueError as error:
        parser.error(str(error))
    return args


def run_demo(argv: Sequence[str]) -> int:
    """Train the zoo GPT for a few steps with zeroc; print the loss per step and the plan.

    Under torchrun on torchrun's world, else on ``--nproc`` ranks of this machine; the exit
    code (130 after Ctrl-C).
    """
    args = parse_args(argv)
    log.debug("%s: %d ranks on %s%s", NAME, args.nproc, args.device,
              " (torchrun)" if in_torchrun() else "")
    if in_torchrun():
        return run_torchrun(_train_rank, args, device=args.device, name=NAME)
    return run_local_ranks(_train_rank, args.nproc, args, device=args.device, name=NAME)


def _train_rank(rank: int, world: int, args: argparse.Namespace) -> int:
    return _train(args, rank, world)


def _train(args: argparse.Namespace, rank: int, world: int) -> int:
    """One rank's training loop; rank 0 prints the losses (zeroc and eager) and the plan."""
    sys.path.insert(0, _zoo_path())
    from models.gpt import GPT, GPTConfig

    import zeroc
    from zeroc.sharding.parallelize import parallelize

    device = (torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda"
              else torch.device("cpu"))
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers,
                    n_head=4, d_model=args.width)
    model = GPT(cfg).to(device)
    reference = copy.deepcopy(model)
    size = sum(p.numel() for p in model.parameters())
    options = {}
    if args.zero is not None or args.pp > 1:
        parallelize(model, zero=3 if args.zero is None else args.zero, pp=args.pp)
        if args.pp > 1:
            options = {"schedule": args.schedule, "microbatches": args.microbatches}
    compiled = torch.compile(model, backend="zeroc", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(args.seed + 1)
    dp = world // args.pp
    rows = args.batch // dp
    lo = rank % dp * rows
    if rank == 0:
        layout = (f", {world} {backend_for(args.device)} ranks, zero {args.zero}, pp {args.pp}"
                  if world > 1 else "")
        if args.pp > 1:
            layout += f", schedule {args.schedule}"
        print(f"zeroc demo: GPT {size / 1e6:.2f}M params, batch {args.batch}x{args.seq}, "
              f"{args.steps} AdamW steps on {device}{layout}")
        print(f"{'step':>4}  {'zeroc loss':>12}  {'eager loss':>12}  {'ms':>8}", flush=True)
    for step in range(args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1),
                               generator=data).to(device)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        start = time.perf_counter()
        loss = compiled(x[lo:lo + rows], y[lo:lo + rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = (time.perf_counter() - start) * 1e3
        shown = loss.detach().to(device, copy=True)  # a pipeline's loss may be on the CPU
        if world > 1:  # each data-parallel replica has its own batch's loss: show the mean
            dist.all_reduce(shown)
            shown /= world
        if rank == 0:
            ref_loss = reference(x, y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            print(f"{step:>4}  {shown.item():>12.6f}  {ref_loss.item():>12.6f}  {elapsed:>8.1f}",
                  flush=True)
    if rank == 0:
        print()
        print(zeroc.explain(compiled))
    return 0
