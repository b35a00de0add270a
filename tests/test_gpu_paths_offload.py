"""Optimizer offload on a world-1 process group (one GPU's job, or ``torchrun
--nproc-per-node 1``), on gloo here.

A one-rank group still makes the visible parameters DTensors on its data-parallel mesh, so
offload needs a host mesh there too (``runtime/mesh.host_dp_mesh``; it once refused with
"an offloaded DTensor parameter needs a host mesh"). The offloaded model trains to the same
losses as the model without offload, with its optimizer state on the host.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from models.gpt import GPT, GPTConfig

import zeroc


def _losses(offload: str | None, steps: int = 3) -> tuple[list[float], torch.optim.Optimizer]:
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32),
                seed=0)
    zeroc.parallelize(model, zero=3, offload=offload)
    compiled = torch.compile(model, backend="zeroc")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    losses = []
    for _ in range(steps):
        loss = compiled(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses, optimizer


@pytest.mark.timeout(120)
def test_offload_trains_on_a_world_1_group(tmp_path) -> None:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        plain, _ = _losses(None)
        torch.compiler.reset()
        offloaded, optimizer = _losses("optimizer")
    finally:
        torch.compiler.reset()
        dist.destroy_process_group()
    assert offloaded == plain
    state = next(iter(optimizer.state.values()))
    assert state["exp_avg"].device.type == "cpu"
