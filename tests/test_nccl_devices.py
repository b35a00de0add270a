"""NCCL's device rule in the planned world (``zeroc.runtime.nccl_devices``).

NCCL takes only tensors on the rank's GPU; gloo takes CPU tensors too, so the multi-process
tests cannot see a CPU tensor reaching a collective. The planned world runs every rank's real
program on fake CUDA tensors under ``StrictDevices``: a CPU tensor given to any collective
raises, naming the call site. Here: the rule itself, then a pipeline and a ZeRO-3 step and
what a user's loop calls after it (the loss, ``clip_grad_norm_``, ``full_state_dict`` and
``load_full_state_dict``, tune's agreement and input broadcast, calibrate's measured
collectives and agreement) without one CPU tensor reaching a collective. (The compiled graphs'
comparison across ranks goes through the job's store: no tensor at all.)
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from models.gpt import GPT, GPTConfig
from torch._subclasses.fake_tensor import DataDependentOutputException

import zeroc
from zeroc.runtime import nccl_devices
from zeroc.runtime.cost.calibration import _runs
from zeroc.runtime.mesh import group_device
from zeroc.runtime.nccl_devices import CollectiveDeviceError
from zeroc.tuning.calibrate import _agree
from zeroc.tuning.tune import _agree_failed, _same_inputs
from zeroc.world.fake_world import _fake_inputs, fake_world, loss_of, meta_copy, planned_world


def _gpt(layers: int = 2) -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, d_model=32),
               seed=1)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


@contextlib.contextmanager
def _rank_after_a_step(pp: int, zero: int, world: int = 4, rank: int = 0,
                       options: dict | None = None) -> Iterator[tuple]:
    """Global ``rank`` of a planned CUDA world after one training step: (model, loss)."""
    with fake_world(rank, world, pp, "cuda"):
        planned = planned_world(rank, world, pp, "cuda")
        args, kwargs = _fake_inputs(_batch(), planned.device)
        # One block per stage: DualPipeV runs 2 * pp stages.
        layers = 2 * pp if (options or {}).get("schedule") == "dualpipev" else 2
        model = zeroc.parallelize(meta_copy(_gpt(layers)), zero=zero, pp=pp,
                                  planned_world=planned)
        compiled = torch.compile(model, backend="zeroc", options=dict(options or {}))
        optimizer = torch.optim.AdamW(model.parameters())
        loss = loss_of(compiled(*args, **kwargs))
        loss.backward()
        optimizer.step()
        yield model, loss


def test_a_cpu_tensor_on_a_collective_raises_naming_the_call_site() -> None:
    with fake_world(0, 2, 1, "cuda"):
        assert group_device().type == "cuda"
        dist.all_reduce(torch.ones(3, device="cuda"))  # on the rank's device: accepted
        line = sys._getframe().f_lineno + 2
        with pytest.raises(CollectiveDeviceError) as caught:
            dist.all_reduce(torch.ones(3, device="cpu"))
        message = str(caught.value)
        assert f"test_nccl_devices.py:{line}" in message
        assert "float32 tensor of shape [3] on cpu" in message
        assert "c10d.allreduce_" in message and "cuda:0" in message
        with pytest.raises(CollectiveDeviceError, match="send"):
            dist.send(torch.ones(2), dst=1)


def test_the_rule_checks_compiled_graphs_and_host_collectives(monkeypatch) -> None:
    seen: dict[str, int] = {}
    original = nccl_devices.StrictDevices.__torch_dispatch__

    def spy(self, func, types, args=(), kwargs=None):
        if func.namespace in nccl_devices._COLLECTIVE_NAMESPACES:
            seen[func.namespace] = seen.get(func.namespace, 0) + 1
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(nccl_devices.StrictDevices, "__torch_dispatch__", spy)
    with _rank_after_a_step(pp=1, zero=3, world=2) as (_, loss):
        assert loss.device.type == "cuda"
    assert seen.get("_c10d_functional", 0) > 0  # the compiled graphs' gathers and scatters
    seen.clear()
    with _rank_after_a_step(pp=2, zero=3, options={"schedule": "dualpipev"}) as (_, loss):
        assert loss.device.type == "cuda"
    assert seen.get("c10d", 0) > 0  # p2p, hoisted gathers, reductions, step digests


@pytest.mark.parametrize("pp", [1, 2])
def test_what_a_loop_calls_after_a_step_stays_on_the_device(pp: int) -> None:
    with _rank_after_a_step(pp=pp, zero=3) as (model, loss):
        assert loss.device.type == "cuda"
        norm = zeroc.clip_grad_norm_(model, 1.0)
        assert norm.device.type == "cuda"
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        full = zeroc.full_state_dict(model)
        assert all(t.device.type == "cuda" for t in full.values())
        # These read an agreed value on the host after their collective; fake tensors have
        # none, so each is run up to that read, its collectives checked.
        _collectives_then_value_read(lambda: zeroc.load_full_state_dict(model, full))
        _collectives_then_value_read(lambda: _agree_failed(False))
        # calibrate's collective runs and its agreement on what they measured.
        group = dist.group.WORLD
        for run in _runs(group, group_device(), 1 << 12, as_all_to_all=pp == 1):
            run()
        _collectives_then_value_read(lambda: _agree({"cuda": {"mm": 1.0}}, 1e9, 1e-5, {},
                                                    group_device()))
        x, y = _fake_inputs(_batch(), torch.device("cuda", 0))[0]
        check = nccl_devices.active_check()
        before = check.checked
        _same_inputs((x.cpu(), y.cpu()))  # a user's CPU batch is moved, then broadcast
        assert check.checked == before + 2


def _collectives_then_value_read(call) -> None:
    """Run ``call`` in the planned world, which stops it where it reads a value on the host
    (fake tensors have none): at least one collective ran before, and passed the rule."""
    check = nccl_devices.active_check()
    before = check.checked
    with pytest.raises(DataDependentOutputException):
        call()
    assert check.checked > before


@pytest.mark.parametrize("zero", [1, 3])
def test_a_model_built_on_the_cpu_moves_to_the_groups_device(zero: int) -> None:
    """The README's loop on a GPU node: the model is built on the CPU, then parallelized on a
    CUDA group. Its parameters are broadcast and sharded on the group's device (a CPU tensor
    on the broadcast would raise here), and its buffers move there too, as FSDP2 moves them.
    ``parallelize`` is called as the user calls it (no ``planned_world=``): inside the fake
    world it plans there and runs the model's own initialization. The loop then runs as
    written: compile, a step, clipping, the optimizer, all on the device."""
    with fake_world(0, 2, 1, "cuda"):
        model = _gpt()  # the fake world's tensors: made on the CPU
        model.register_buffer("scale", torch.ones(3))
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        check = nccl_devices.active_check()
        before = check.checked
        zeroc.parallelize(model, zero=zero)
        assert check.checked > before  # the broadcasts ran, on the device
        assert {p.device for p in model.parameters()} == {torch.device("cuda", 0)}
        assert {b.device for b in model.buffers()} == {torch.device("cuda", 0)}
        _train_one_step(model)


@pytest.mark.parametrize("pp", [1, 2])
def test_a_meta_model_with_init_fn_runs_the_loop_on_the_device(pp: int) -> None:
    """A model built on meta and initialized by the user's ``init_fn`` on the planned GPU: the
    initializer runs (once on meta as a dry run, then on the device; at pp=2 only for this
    rank's stages, after the split, under rank 0's generator state), then the loop."""
    seen: list[torch.device] = []

    def init_fn(module: torch.nn.Module) -> None:
        for param in module.parameters(recurse=False):
            seen.append(param.device)
            torch.nn.init.normal_(param, std=0.02)

    with fake_world(0, 2, pp, "cuda"):
        with torch.device("meta"):
            model = _gpt()
        zeroc.parallelize(model, zero=3, pp=pp, init_fn=init_fn)
        assert torch.device("cuda", 0) in seen
        _train_one_step(model)


def _train_one_step(model: torch.nn.Module) -> None:
    """The README's loop body on a planned rank: every tensor it makes stays on the device."""
    compiled = torch.compile(model, backend="zeroc")
    optimizer = torch.optim.AdamW(model.parameters())
    args, kwargs = _fake_inputs(_batch(), torch.device("cuda", 0))
    loss = loss_of(compiled(*args, **kwargs))
    loss.backward()
    norm = zeroc.clip_grad_norm_(model, 1.0)
    optimizer.step()
    optimizer.zero_grad()
    assert loss.device == norm.device == torch.device("cuda", 0)
    assert {s["exp_avg"].device for s in optimizer.state.values()} == {torch.device("cuda", 0)}


def test_a_cpu_batch_where_the_group_is_on_cuda_is_refused_naming_the_input() -> None:
    with fake_world(0, 2, 1, "cuda"):
        model = zeroc.parallelize(meta_copy(_gpt()), zero=3,
                                  planned_world=planned_world(0, 2, 1, "cuda"))
        compiled = torch.compile(model, backend="zeroc")
        x, y = _fake_inputs(_batch(), torch.device("cpu"))[0]
        with pytest.raises(ValueError, match=r"input idx is a tensor of shape \[8, 16\] "
                           r"on the CPU.*cuda:0"):
            compiled(x, y)
        with pytest.raises(ValueError, match=r"input targets= is a tensor of shape"):
            compiled(_fake_inputs(_batch(), torch.device("cuda", 0))[0][0], targets=y)
