"""Every tensor on the right device: a training step in a fake CUDA world.

ZeRO-3 at dp=2, pp=2 DualPipeV and pp=2 x dp=2 ZeRO-3 each run one planned step with
``device="cuda"``; a dispatch mode records the device of every tensor given to a collective
(``c10d`` and ``_c10d_functional`` ops) and a p2p call, and every compiled graph's inputs:
all must be CUDA tensors. Fake CUDA tensors need a CUDA build of torch for the backward
(AOTAutograd traces it through the autograd engine, which refuses CUDA tensors when torch has
no CUDA): on a CPU-only build the test is skipped, saying so.
"""

from __future__ import annotations

import pytest
import torch
from models.gpt import GPT, GPTConfig
from torch.utils._pytree import tree_leaves

import zeroc
from zeroc.runtime import step_memory
from zeroc.runtime.step_memory import StepMemory

pytestmark = pytest.mark.skipif(
    not torch.backends.cuda.is_built(),
    reason="fake CUDA training steps need a CUDA build of torch (the autograd engine refuses "
           "CUDA tensors on a CPU-only build)")


DEVICES: dict[str, set[str]] = {}


class DeviceLog(StepMemory):
    """The step's memory tracker, also noting the device of every tensor given to a
    collective or p2p op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith(("c10d::", "_c10d_functional::")):
            for value in tree_leaves((args, kwargs or {})):
                if isinstance(value, torch.Tensor):
                    DEVICES.setdefault(name, set()).add(value.device.type)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _graph_inputs(monkeypatch) -> dict[str, set[str]]:
    from zeroc.runtime.executor import GraphExecutor

    seen: dict[str, set[str]] = {}
    run = GraphExecutor._run

    def recording(self, inputs):
        for value in inputs:
            if isinstance(value, torch.Tensor):
                seen.setdefault(self.name, set()).add(value.device.type)
        return run(self, inputs)

    monkeypatch.setattr(GraphExecutor, "_run", recording)
    return seen


@pytest.mark.parametrize(("world", "pp", "schedule"), [(2, 1, None), (2, 2, "dualpipev"),
                                                       (4, 2, "1f1b")])
def test_every_collective_p2p_and_graph_input_is_on_cuda(monkeypatch, world, pp,
                                                         schedule) -> None:
    seen = _graph_inputs(monkeypatch)
    DEVICES.clear()
    monkeypatch.setattr(step_memory, "StepMemory", DeviceLog)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32))
    tokens = torch.zeros(8, 16, dtype=torch.long)
    options = {"schedule": schedule} if schedule else {}
    zeroc.explain(model, (tokens, tokens), world=world, pp=pp, zero=3, device="cuda",
                  options=options)
    assert DEVICES, "no collective was recorded"
    assert all(d == {"cuda"} for d in DEVICES.values()), DEVICES
    assert seen and all(d == {"cuda"} for d in seen.values()), seen
