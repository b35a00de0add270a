"""``python -m zeroc demo``: train the zoo GPT with zeroc and print the plan and the loss.

The demo trains the GPT of the model zoo (``tests/models`` of the source checkout) on random
tokens, step by step, next to an eager copy of the same model, and prints both losses so the
parity is visible, then the plan zeroc compiled.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections.abc import Sequence

import torch


def _zoo_path() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.join(os.path.dirname(here), "tests")
    if not os.path.isdir(os.path.join(tests, "models")):
        raise SystemExit(
            "zeroc demo: the model zoo (tests/models) was not found next to the package; run "
            "the demo from a source checkout installed with `pip install -e .`"
        )
    return tests


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m zeroc demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--layers", type=int, default=4, help="GPT blocks (default 4)")
    parser.add_argument("--width", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "seq", "layers", "width"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    return args


def run_demo(argv: Sequence[str]) -> int:
    """Train the zoo GPT for a few steps with zeroc; print the loss per step and the plan."""
    args = parse_args(argv)
    sys.path.insert(0, _zoo_path())
    from models.gpt import GPT, GPTConfig

    import zeroc

    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers,
                    n_head=4, d_model=args.width)
    model = GPT(cfg)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="zeroc")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(args.seed + 1)
    print(f"zeroc demo: GPT {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"batch {args.batch}x{args.seq}, {args.steps} AdamW steps on {torch.device('cpu')}")
    print(f"{'step':>4}  {'zeroc loss':>12}  {'eager loss':>12}  {'ms':>8}")
    for step in range(args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=data)
        x, y = tokens[:, :-1], tokens[:, 1:]
        start = time.perf_counter()
        loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        elapsed = (time.perf_counter() - start) * 1e3
        ref_loss = reference(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        print(f"{step:>4}  {loss.item():>12.6f}  {ref_loss.item():>12.6f}  {elapsed:>8.1f}")
    print()
    print(zeroc.explain(compiled))
    return 0
