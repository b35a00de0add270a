"""Device memory as a GPU would count it, in the fake CUDA world
(``zeroc.world.device_allocations``).

A rank of a pp=2 x dp=2 ZeRO-3 job (world 4) runs as a user's script would: ``parallelize``,
``torch.compile``, three training steps with AdamW, one call under ``torch.no_grad()``, with
every allocation on its device counted from the moment the fake world starts. For the zoo
GPT (DualPipeV: two stages per rank) and a small Hugging Face Llama (1F1B), on the first rank
of each pipeline position:

- the most bytes alive at once over that whole run is the plan's per-rank peak
  (``zeroc.explain(world=4, ...)``: a step in the steady state, the optimizer state alive)
  within 5%;
- no allocation has the full shape of a parameter sharded over dp unless a gather made it
  or it is a gradient (a backward graph's output, the step's copy of it, the reduction's
  buckets); nothing of that shape is allocated outside a step (the compile, the traces, the
  optimizer) or still alive after the steps. Stage graphs traced on full-size
  ``torch.empty`` parameters on the device, kept by the forward-only graph until its first
  call, fail all three (their peak is 15-17% above the plan's).

The ledger itself: factory functions, op outputs, views, frees, storages made without an op
or resized in place, other fake modes' tensors and ops dispatched while a trace runs.
"""

from __future__ import annotations

import functools

import pytest
import torch
from models.gpt import GPT, GPTConfig
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx

import zeroc
from zeroc.runtime.step_memory import note_made, note_resized
from zeroc.world.device_allocations import Allocation, RankRun, count_rank, counting

WORLD, PP = 4, 2
RANKS = (0, 2)  # the first rank of each pipeline position


def _gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32), seed=5)


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        use_cache=False)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def _case(name: str) -> tuple:
    """(model, example inputs, compile options) of a case."""
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(3))
    if name == "gpt":
        return (_gpt(), (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()),
                {"schedule": "dualpipev", "microbatches": 4})
    inputs = {"input_ids": tokens[:, :16], "labels": tokens[:, 1:]}
    return _llama(), inputs, {"schedule": "1f1b", "microbatches": 4}


@functools.cache
def _planned(name: str) -> tuple[int, ...]:
    model, inputs, options = _case(name)
    plan = zeroc.explain(model, inputs, world=WORLD, pp=PP, zero=3, device="cuda",
                         options=options)
    return tuple(m.peak for m in plan.memory)


@functools.cache
def _counted(name: str, rank: int) -> RankRun:
    model, inputs, options = _case(name)
    return count_rank(model, inputs, rank=rank, world=WORLD, pp=PP, zero=3, device="cuda",
                      steps=3, no_grad_calls=1, options=options)


def _gradient(allocation: Allocation) -> bool:
    """Made by a stage graph, by the step's reduction, or copied by the step's accumulation."""
    return allocation.label in ("graph", "gradient") or (
        allocation.in_step and allocation.site.endswith(" in _accumulate"))


def _full_size(run: RankRun, allocations=None, any_shape: bool = False
               ) -> list[tuple[str, Allocation]]:
    """Allocations the size of a full sharded parameter, but the shards ``parallelize``
    makes (on these small models a shard of one parameter can have another's numel)."""
    return [(name, a) for name, a in run.full_size(allocations, any_shape)
            if a.label != "parameter shard"]


CASES = [pytest.param("gpt", id="zoo-gpt"),
         pytest.param("llama", id="hf-llama", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name", CASES)
def test_a_ranks_whole_run_peak_is_the_planned_peak(name: str) -> None:
    planned = _planned(name)
    for rank in RANKS:
        run = _counted(name, rank)
        assert run.ledger.allocations and planned[rank] > 0
        ratio = run.ledger.peak / planned[rank]
        assert abs(ratio - 1) <= 0.05, (rank, run.ledger.peak, planned[rank],
                                        run.ledger.summary())


@pytest.mark.parametrize("name", CASES)
def test_no_full_size_parameter_is_allocated_outside_a_gather(name: str) -> None:
    for rank in RANKS:
        run = _counted(name, rank)
        # A gather unpacks its buffer row by row: parameters of any shape, all in the step.
        gathered = [a for _, a in _full_size(run, any_shape=True) if a.gathered]
        assert gathered and all(a.in_step for a in gathered), rank
        others = [(n, a.shape, a.op, a.label, a.site) for n, a in _full_size(run)
                  if not a.gathered and not _gradient(a)]
        assert not others, (rank, others[:8])


@pytest.mark.parametrize("name", CASES)
def test_the_compile_allocates_and_keeps_no_full_size_parameter(name: str) -> None:
    """Outside the steps (parallelize, the compile and its traces, the optimizer) nothing of
    a full parameter's size is allocated, and nothing of that size outlives the steps."""
    for rank in RANKS:
        run = _counted(name, rank)
        outside = [(n, a.shape, a.op, a.site) for n, a in _full_size(run) if not a.in_step]
        assert not outside, (rank, outside[:8])
        kept = [(n, a.shape, a.site) for n, a in _full_size(run, run.live_after)]
        assert not kept, (rank, kept[:8])
        # What happens outside the steps is counted: the shards, the optimizer's state.
        labels = {a.label for a in run.ledger.allocations if not a.in_step}
        assert {"parameter shard", "optimizer"} <= labels, labels


def test_the_ledger_counts_what_the_device_holds() -> None:
    mode = FakeTensorMode()
    with mode, counting("cpu", mode) as ledger:
        a = torch.empty(1024)  # a factory function: 4 KiB
        view = a.view(32, 32)  # a view: the same storage
        b = a * 2  # an op's output: 4 KiB more
        assert (ledger.live, ledger.peak, len(ledger.allocations)) == (8192, 8192, 2)
        del b
        assert ledger.live == 4096 and ledger.peak == 8192
        other = FakeTensorMode()
        with unset_fake_temporarily():  # another mode's tensors are no device memory here
            stranger = other.from_tensor(torch.empty(4096))
            _ = stranger + 1
        traced = make_fx(lambda t: (t.sin() + 1).cos())(view)  # a trace allocates nothing
        assert len(traced.graph.nodes) > 2
        assert ledger.live == 4096 and len(ledger.allocations) == 2
        made = torch.empty(256, device="meta")
        note_made(made)  # another device: not counted
        with unset_fake_temporarily():
            direct = FakeTensor(mode, torch.empty(256, device="meta"), torch.device("cpu"))
        note_made(direct, "parameter shard")  # made without an op: counted once
        note_made(direct)
        assert ledger.live == 4096 + 1024
        assert ledger.allocations[-1].label == "parameter shard"
        a.untyped_storage().resize_(0)
        note_resized(a)
        assert ledger.live == 1024 and ledger.peak == 8192
        ledger.raise_peak(10000)  # a working set without ops (a replayed graph's)
        assert ledger.peak == 11024
    assert {x.op for x in ledger.allocations} >= {"aten.empty.memory_format", "aten.mul.Tensor"}
