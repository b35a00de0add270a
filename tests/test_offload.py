"""Optimizer offload (``zeroc.parallelize(model, zero=2 or 3, offload="optimizer")``).

On 2 gloo ranks the offloaded run equals the run without offload exactly (losses, clipped
gradient norms, parameters), with its master rows, gradients and Adam state in tensors of
their own; a DCP checkpoint of it resumes exactly, loaded either way. In the fake CUDA world
(the strict NCCL device rules on) every graph input stays on the device, every offloaded
tensor is on the host, and the plan's device memory drops by the gradients and Adam state:
12 bytes per element of the shard at rest, 8 at the measured peak of a planned step.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from models.gpt import GPT, GPTConfig
from parity import ADAM
from test_torch_distributed import _load, make_gpt, train_ranks

import zeroc


def train_and_resume(rank: int, world: int, directory: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    out = {}
    for zero in (3, 2):
        for offload in (None, "optimizer"):
            torch._dynamo.reset()
            model = zeroc.parallelize(make_gpt(), zero=zero, offload=offload)
            optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
            losses, norms = train_ranks(model, optimizer, range(2), rank, world, clip=0.05)
            if offload is not None and zero == 3:
                dcp.save({"model": get_model_state_dict(model),
                          "optim": get_optimizer_state_dict(model, optimizer)},
                         checkpoint_id=directory)
                apart = all(
                    s.host.untyped_storage().data_ptr() != s.flat.untyped_storage().data_ptr()
                    for s in model._zeroc_state.params)
                out["host_rows_apart"] = apart
            more, more_norms = train_ranks(model, optimizer, range(2, 4), rank, world, clip=0.05)
            out[(zero, offload)] = {"losses": losses + more, "norms": norms + more_norms,
                                    "full": zeroc.full_state_dict(model)}
    for in_place in (False, True):
        torch._dynamo.reset()
        model = zeroc.parallelize(GPT(GPTConfig.tiny(), seed=99), zero=3, offload="optimizer")
        optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
        if in_place:  # a full state dict first (the other values), then DCP over it
            zeroc.load_full_state_dict(model, GPT(GPTConfig.tiny(), seed=7).state_dict())
        _load(model, optimizer, directory, in_place=in_place)
        losses, norms = train_ranks(model, optimizer, range(2, 4), rank, world, clip=0.05)
        out[("resumed", in_place)] = {"losses": losses, "norms": norms,
                                      "full": zeroc.full_state_dict(model)}
    # load_full_state_dict writes the host master rows too: the next step starts from them.
    torch._dynamo.reset()
    model = zeroc.parallelize(GPT(GPTConfig.tiny(), seed=99), zero=3, offload="optimizer")
    zeroc.load_full_state_dict(model, make_gpt().state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    out["full_load"] = train_ranks(model, optimizer, range(2), rank, world, clip=0.05)[0]
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_offload_equals_the_run_without_it_and_resumes_from_dcp(tmp_path) -> None:
    got = run_ranks(train_and_resume, 2, str(tmp_path / "ckpt"), timeout=500)[0]
    assert got["host_rows_apart"]
    for zero in (3, 2):
        plain, offloaded = got[(zero, None)], got[(zero, "optimizer")]
        assert offloaded["losses"] == plain["losses"], zero
        assert offloaded["norms"] == plain["norms"], zero
        for key, value in plain["full"].items():
            assert torch.equal(offloaded["full"][key], value), (zero, key)
    reference = got[(3, "optimizer")]
    assert got["full_load"] == reference["losses"][:2]
    for in_place in (False, True):
        resumed = got[("resumed", in_place)]
        assert resumed["losses"] == reference["losses"][2:], in_place
        for key, value in reference["full"].items():
            assert torch.equal(resumed["full"][key], value), (in_place, key)


def plan_step(offload: str | None):
    """One fake-CUDA step of rank 0 of 2 at ZeRO-3: the devices of what it holds, its plan's
    memory row."""
    from zeroc.world.fake_world import fake_world, meta_copy, planned_world

    torch._dynamo.reset()
    planned = planned_world(0, 2, 1, "cuda")
    with fake_world(0, 2, 1, "cuda"):
        tokens = torch.zeros(4, 16, dtype=torch.long, device=planned.device)
        model = zeroc.parallelize(meta_copy(GPT(GPTConfig.tiny(), seed=0)), zero=3,
                                  planned_world=planned, offload=offload)
        optimizer = torch.optim.AdamW(model.parameters())
        compiled = torch.compile(model, backend="zeroc")
        compiled(tokens, tokens).backward()
        optimizer.step()

        def device(value):
            return (value.to_local() if hasattr(value, "to_local") else value).device.type

        state = model._zeroc_state.params
        held = {
            "graph inputs": {s.flat.device.type for s in state},
            "host rows": {s.host.device.type for s in state if s.host is not None},
            "parameters": {device(p) for p in model.parameters()},
            "gradients": {device(p.grad) for p in model.parameters()},
            "optimizer": {device(v) for st in optimizer.state.values() for v in st.values()
                          if v.dim()},
        }
        shard = sum(s.flat.numel() for s in state)
        memory = zeroc.explain(compiled).memory[0]
    return held, memory, shard


@pytest.mark.timeout(600)
def test_offloaded_tensors_are_on_the_host_in_the_fake_cuda_world() -> None:
    held, memory, shard = plan_step("optimizer")
    assert held == {"graph inputs": {"cuda"}, "host rows": {"cpu"}, "parameters": {"cpu"},
                    "gradients": {"cpu"}, "optimizer": {"cpu"}}
    plain_held, plain, _ = plan_step(None)
    assert plain_held["optimizer"] == {"cuda"}
    assert (memory.grads, memory.optimizer) == (0, 0)
    assert plain.peak - memory.peak == 12 * shard  # fp32 gradient + Adam's two moments
    assert memory.host == 16 * shard  # and the fp32 master rows, on the host
    assert memory.params == plain.params
    # The world plan measures the step on its fake tensors: at the peak the gradients are
    # still on the device while the backward makes them, so the peak drops by the moments.
    batch = torch.zeros(4, 16, dtype=torch.long)
    planned = {o: zeroc.explain(GPT(GPTConfig.tiny(), seed=0), (batch, batch), world=2, zero=3,
                                device="cuda", offload=o).memory[0] for o in (None, "optimizer")}
    assert (planned["optimizer"].grads, planned["optimizer"].optimizer) == (0, 0)
    assert planned[None].peak - planned["optimizer"].peak == 8 * shard
    assert planned["optimizer"].host == 16 * shard


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"zero": 1, "offload": "optimizer"}, r"offload='optimizer'.*needs zero=2 or zero=3; "
                                          r"got zero=1"),
    ({"zero": 3, "offload": "cpu"}, r"offload='cpu' is not allowed; allowed: \[None, "
                                    r"'optimizer'\]"),
])
def test_offload_refuses_what_it_does_not_support(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        zeroc.parallelize(GPT(GPTConfig.tiny(), seed=0), **kwargs)


def test_offload_refuses_pipelines() -> None:
    from zeroc.sharding.offload import check_offload

    with pytest.raises(ValueError, match=r"supported at pp=1 only.*got pp=2"):
        check_offload("optimizer", 3, 2)
