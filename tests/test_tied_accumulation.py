"""Tied weights under gradient accumulation: every use's gradient reduced exactly once.

A tied parameter has several owners (BART's ``model.shared`` is its encoder's and decoder's
embedding and its ``lm_head``, and ``model.shared`` itself is never called); a parameter may
also be read twice in one forward (a block applied twice) or read only for its ``.device``.
Accumulating without synchronisation (``set_requires_gradient_sync(False)``) and then
synchronising must give every parameter eager's gradient, at ZeRO 0 to 3, compiled and eager:
BART compiled and eager at ZeRO-3, GPT2 compiled at ZeRO-3, T5 compiled at ZeRO-2, and a block
applied twice (its head tied to an embedding whose first owner never runs, as BART's
``model.shared``) compiled at ZeRO 0 and 3 and eager at ZeRO-1.

Not run here: BART compiled at ZeRO 0 and 1. The tie that matters at ZeRO-0 (one parameter,
three owners, the first never called) is the reused block's, run compiled there; BART's own
modules run at ZeRO-3, compiled and eager. ZeRO-1 compiled reduces gradients as ZeRO-2 does
(a reduce-scatter into each rank's rows after the last micro-step; the all-gather it adds
after ``optimizer.step()`` is no part of accumulation), which T5 runs compiled here, and the
reused block runs ZeRO-1 eager.

The reference is single-process eager on the same micro-batches: each rank's half of a batch
is one loss, and zeroc averages the ranks' gradients, so eager backpropagates each half's loss
divided by the ranks and the micro-steps.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from models import hf
from parity import assert_tensors_match
from torch import nn

import zeroc

WORLD = 2
MICRO_STEPS = 3
# (model, ZeRO stage, compiled)
CASES = (
    ("bart", 3, True), ("bart", 3, False), ("gpt2", 3, True), ("t5", 2, True),
    ("reused", 3, True), ("reused", 0, True), ("reused", 1, False),
)


class ReusedBlock(nn.Module):
    """A block applied twice, a head tied to an embedding whose first owner never runs, and a
    read of a weight for its device only (as Hugging Face's position embeddings do)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused_owner = nn.Embedding(hf.VOCAB, 16)
        self.embed = nn.Embedding(hf.VOCAB, 16)
        self.embed.weight = self.unused_owner.weight
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, hf.VOCAB, bias=False)
        self.head.weight = self.unused_owner.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=self.block.weight.device)
        hidden = self.embed(input_ids) + positions[:, None].to(torch.float32) * 0.01
        hidden = torch.tanh(self.block(torch.tanh(self.block(hidden))))
        logits = self.head(hidden)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _model(name: str) -> nn.Module:
    torch.manual_seed(7)
    return ReusedBlock() if name == "reused" else hf.UserWrapper(hf.build(name, layers=2))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [hf.token_batch(batch=4, seq=8, seed=step) for step in range(MICRO_STEPS)]


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
    return out


def accumulation_job(rank: int, world: int) -> dict:
    results = {}
    for name, zero, compiled in CASES:
        torch._dynamo.reset()
        model = zeroc.parallelize(_model(name), zero=zero)
        run = torch.compile(model, backend="zeroc") if compiled else model
        for step, (ids, labels) in enumerate(_batches()):
            model.set_requires_gradient_sync(step == MICRO_STEPS - 1)
            loss = run(ids.chunk(world)[rank], labels.chunk(world)[rank])
            (loss / MICRO_STEPS).backward()
        results[(name, zero, compiled)] = _full_grads(model)
    return results


def _eager(name: str) -> dict[str, torch.Tensor]:
    model = _model(name)
    for ids, labels in _batches():
        for half in range(WORLD):
            loss = model(ids.chunk(WORLD)[half], labels.chunk(WORLD)[half])
            (loss / MICRO_STEPS / WORLD).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tied_and_reused_weights_accumulate_exactly() -> None:
    ranks = run_ranks(accumulation_job, WORLD, timeout=550)
    references = {name: _eager(name) for name in dict.fromkeys(c[0] for c in CASES)}
    for case in CASES:
        for rank, result in enumerate(ranks):
            assert_tensors_match(references[case[0]], result[case],
                                 f"{case} rank {rank}")
