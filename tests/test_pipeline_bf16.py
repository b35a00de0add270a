"""A bf16 pipeline without the fused loss: the backward's seed takes the loss's dtype.

Under ``MixedPrecision(param_dtype=torch.bfloat16)`` with ``fused_loss=False`` the last stage
returns a bf16 loss; the executor seeded each micro-batch's backward with a float32 tangent
and the stage's backward raised ("expected scalar type BFloat16 but found Float"). Both
ranks of a pp=2 pipeline now train, with finite gradients, and agree on the loss.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import run_ranks
from models.gpt import GPT, GPTConfig

import zeroc


def bf16_job(rank: int, world: int) -> tuple[float, float]:
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32),
                seed=1)
    zeroc.parallelize(model, zero=3, pp=2,
                      mixed_precision=zeroc.MixedPrecision(param_dtype=torch.bfloat16))
    compiled = torch.compile(model, backend="zeroc", options={
        "schedule": "1f1b", "microbatches": 2, "fused_loss": False})
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    loss = compiled(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    loss.backward()
    norm = sum(p.grad.float().norm().item() ** 2 for p in model.parameters()
               if p.grad is not None)
    return loss.item(), norm


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_bf16_pipeline_without_the_fused_loss_trains() -> None:
    ranks = run_ranks(bf16_job, 2, timeout=250)
    assert ranks[0][0] == ranks[1][0] and math.isfinite(ranks[0][0])
    assert all(math.isfinite(norm) and norm > 0 for _, norm in ranks)
