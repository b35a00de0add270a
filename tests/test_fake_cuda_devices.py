"""Every tensor on the right device: a training step in a fake CUDA world.

ZeRO-3 at dp=2, pp=2 DualPipeV and pp=2 x dp=2 ZeRO-3 each run one planned step with
``device="cuda"``; a dispatch mode records the device of every tensor given to a collective
(``c10d`` and ``_c10d_functional`` ops) and a p2p call, and every compiled graph's inputs:
all must be CUDA tensors. On a CPU-only build of torch the fake CUDA device comes from
``zeroc.world.fake_cuda`` (a fake CUDA device guard, and CUDA hooks that let the autograd engine
take CUDA tensors while planning); afterwards the process's torch has no accelerator, as
before.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from models.gpt import GPT, GPTConfig
from torch.utils._pytree import tree_leaves

import zeroc
from zeroc.runtime import step_memory
from zeroc.runtime.step_memory import StepMemory

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


def _note(seen: dict[str, set[str]], name: str, inputs) -> None:
    for value in inputs:
        if isinstance(value, torch.Tensor):
            seen.setdefault(name, set()).add(value.device.type)


class RecordedStageGraph:
    """A pipeline stage's graph that notes its inputs' devices, then runs."""

    def __init__(self, graph, name: str, seen: dict[str, set[str]]) -> None:
        self.graph, self.name, self.seen = graph, name, seen
        self.num_forward_outputs = getattr(graph, "num_forward_outputs", None)

    def __call__(self, *args):
        _note(self.seen, self.name, args)
        return self.graph(*args)


def _graph_inputs(monkeypatch) -> dict[str, set[str]]:
    """The devices of the inputs of every graph run: whole-model graphs (``GraphExecutor``)
    and pipeline stage graphs (those of each ``PipelineExecutor``'s stage programs)."""
    from zeroc.runtime.executor import GraphExecutor
    from zeroc.runtime.pipeline.executor import PipelineExecutor

    seen: dict[str, set[str]] = {}
    run = GraphExecutor._run

    def recording(self, inputs):
        _note(seen, self.name, inputs)
        return run(self, inputs)

    init = PipelineExecutor.__init__

    def recording_stages(self, program, planned=None) -> None:
        stages = []
        for stage in program.stages:  # a frozen Program: its stages are replaced
            index = stage.index
            graphs = {kind: RecordedStageGraph(getattr(stage, kind), f"s{index}.{kind}", seen)
                      for kind in ("forward", "backward", "input_grad", "weight_grad")}
            overlapped = {b_stage: RecordedStageGraph(graph, f"s{index}.fb{b_stage}", seen)
                          for b_stage, graph in stage.overlapped.items()}
            stages.append(dataclasses.replace(stage, overlapped=overlapped, **graphs))
        init(self, dataclasses.replace(program, stages=tuple(stages)), planned)

    monkeypatch.setattr(GraphExecutor, "_run", recording)
    monkeypatch.setattr(PipelineExecutor, "__init__", recording_stages)
    return seen


@pytest.mark.parametrize(("world", "pp", "schedule"), [(2, 1, None), (2, 2, "dualpipev"),
                                                       (4, 2, "1f1b")])
def test_every_collective_p2p_and_graph_input_is_on_cuda(monkeypatch, world, pp,
                                                         schedule) -> None:
    seen = _graph_inputs(monkeypatch)
    DEVICES.clear()
    monkeypatch.setattr(step_memory, "StepMemory", DeviceLog)
    layers = 4 if schedule == "dualpipev" else 2  # one block per DualPipeV stage
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, d_model=32))
    tokens = torch.zeros(8, 16, dtype=torch.long)
    options = {"schedule": schedule} if schedule else {}
    accelerator = torch.accelerator.current_accelerator()
    zeroc.explain(model, (tokens, tokens), world=world, pp=pp, zero=3, device="cuda",
                  options=options)
    assert DEVICES, "no collective was recorded"
    assert all(d == {"cuda"} for d in DEVICES.values()), DEVICES
    assert seen and all(d == {"cuda"} for d in seen.values()), seen
    assert torch.accelerator.current_accelerator() == accelerator
