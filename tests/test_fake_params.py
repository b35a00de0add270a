"""A planned rank's parameters made without dispatching ops (``zeroc.sharding.fake_params``).

In the fake world ``zeroc.parallelize`` makes each flat buffer and visible parameter directly
from meta tensors; they must be the tensors the dispatched ops make, in every property the
compiler, the executor and the plan read. The planning shortcuts together (these parameters,
the step's skipped in-place gradient additions on fakes, and graph replay) must leave every
figure of a planned world as it is without them.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

import zeroc
from zeroc.runtime import fake_replay
from zeroc.world import fake_world, plan_workers

# The module, not the function ``zeroc.parallelize`` that shadows it on the package.
PARALLELIZE = importlib.import_module("zeroc.sharding.parallelize")


def _llama(layers: int = 2):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
        tie_word_embeddings=layers % 2 == 1)  # one case with a tied parameter
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def _mesh_ranks(mesh) -> list:
    with _disable_current_modes():  # the mesh's rank table is a real tensor
        return mesh.mesh.tolist()


def _facts(tensor: torch.Tensor) -> tuple:
    local = getattr(tensor, "_local_tensor", None)
    spec = getattr(tensor, "_spec", None)
    return (
        type(tensor).__name__, isinstance(tensor, nn.Parameter), tuple(tensor.shape),
        tensor.stride(), tensor.dtype, tensor.device, tensor.requires_grad,
        None if spec is None else (spec.placements, _mesh_ranks(spec.mesh),
                                   spec.mesh.mesh_dim_names, spec.tensor_meta),
        None if local is None else (type(local).__name__, tuple(local.shape), local.stride(),
                                    local.storage_offset(), local.dtype, local.device,
                                    local.requires_grad, local.untyped_storage().nbytes()),
        None if local is not None else tensor.untyped_storage().nbytes(),
    )


def _sharded(rank: int, world: int, pp: int, zero: int, device: str, dispatched: bool,
             monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    with monkeypatch.context() as patch:
        if dispatched:
            patch.setattr(PARALLELIZE, "active_fake_mode", lambda: None)
        replica = fake_world.meta_copy(_llama(3))
        with fake_world.fake_world(rank, world, pp, device):
            model = zeroc.parallelize(
                replica, zero=zero, pp=pp,
                planned_world=fake_world.planned_world(rank, world, pp, device))
            rows = []
            for sharded in model.__dict__["_zeroc_state"].params:
                flat, visible = sharded.flat, sharded.visible
                local = getattr(visible, "_local_tensor", visible)
                rows.append((sharded.record, sharded.placement, sharded.local_offset,
                             _facts(flat), _facts(visible),
                             # the visible parameter views the flat buffer's own storage
                             local.untyped_storage()._cdata == flat.untyped_storage()._cdata,
                             local.storage_offset() - flat.storage_offset()))
            return rows


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("zero,world,pp,rank", [(0, 2, 1, 1), (1, 4, 2, 3), (2, 3, 1, 2),
                                                (3, 8, 2, 7), (3, 4, 1, 0)])
def test_fake_parameters_are_the_dispatched_ones(zero: int, world: int, pp: int, rank: int,
                                                 device: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    direct = _sharded(rank, world, pp, zero, device, False, monkeypatch)
    dispatched = _sharded(rank, world, pp, zero, device, True, monkeypatch)
    assert len(direct) == len(dispatched) > 10
    for made, reference in zip(direct, dispatched, strict=True):
        assert made == reference, made[0].name
    # Each case exercised what it is named for.
    placements = {row[1] for row in direct}
    assert placements == ({"plain"} if zero == 0 else {"shard"})
    assert all(row[5] for row in direct)
    if world % 3 == 0:  # rows that do not divide evenly: a short last shard
        assert any(row[0].local_rows * 3 < row[0].shape[0] + 2 for row in direct)


@pytest.mark.parametrize("schedule", ["1f1b", "zb1p"])
def test_planning_shortcuts_change_no_figure(schedule: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct fake parameters, skipped in-place additions of fakes and graph replay, all on
    or all off: the same plan, figure for figure."""
    tokens = torch.zeros(8, 32, dtype=torch.long)
    monkeypatch.setattr(plan_workers, "planning_cores", lambda: 1)

    def plan():  # one decoder layer per stage: the figures do not depend on how many
        return zeroc.explain(_llama(2), {"input_ids": tokens, "labels": tokens}, world=8, pp=2,
                             zero=3, device="cuda", options={"schedule": schedule,
                                                              "microbatches": 4})

    fast = plan()
    monkeypatch.setattr(PARALLELIZE, "active_fake_mode", lambda: None)
    monkeypatch.setattr(fake_replay, "adds_nothing", lambda target, value: False)
    monkeypatch.setattr(fake_replay, "replayable", lambda graph: False)
    slow = plan()
    assert fast.memory == slow.memory and len(fast.memory) == 8
    assert fast.collectives == slow.collectives and fast.collectives
    assert fast.to_json() == slow.to_json()
