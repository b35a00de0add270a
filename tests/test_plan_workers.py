"""A planned world's positions are split with a forked helper process (two cores).

The plan must be the one planning every position in this process gives; the helper must
really plan its half (in another process); a helper that fails leaves its positions to this
process, and an error of this process's own positions surfaces as it would alone.
"""

from __future__ import annotations

import os

import pytest
import torch
from models.gpt import GPT, GPTConfig

import zeroc
import zeroc.plan_workers as plan_workers
import zeroc.world_plan as world_plan


def _model() -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=8, n_head=2, d_model=32), seed=1)


def _plan(monkeypatch: pytest.MonkeyPatch, cores: int, log_path=None, fail=None):
    """The plan of the GPT at world 8, pp 4 (1F1B) with ``cores`` cores; ``log_path``
    collects ``rank pid`` per planned position (across processes); ``fail(rank)`` may
    raise for a position."""
    monkeypatch.setattr(plan_workers, "planning_cores", lambda: cores)
    plan_position = world_plan.plan_position

    def spy(*args, **kwargs):
        if fail is not None:
            fail(kwargs["rank"])
        planned = plan_position(*args, **kwargs)
        if log_path is not None:
            with open(log_path, "a") as handle:
                handle.write(f"{kwargs['rank']} {os.getpid()}\n")
        return planned

    monkeypatch.setattr(world_plan, "plan_position", spy)
    tokens = torch.zeros(8, 16, dtype=torch.long)
    return zeroc.explain(_model(), (tokens, tokens), world=8, pp=4, zero=3, device="cpu",
                         options={"schedule": "1f1b", "microbatches": 8})


def _summary(plan) -> dict:
    return {"memory": plan.memory, "stages": plan.stages,
            "graphs": [(g.name, g.kind, g.code) for g in plan.graphs],
            "collectives": sorted((c.name, c.graph, c.op, c.bytes) for c in plan.collectives)}


def test_the_helper_plans_half_the_positions_to_the_same_plan(monkeypatch, tmp_path) -> None:
    alone = _summary(_plan(monkeypatch, 1))
    log_path = tmp_path / "planned.txt"
    helped = _summary(_plan(monkeypatch, 2, log_path))
    assert helped == alone
    planned = dict(line.split() for line in log_path.read_text().splitlines())
    assert sorted(int(rank) for rank in planned) == [0, 2, 4, 6]
    here = str(os.getpid())
    # The helper plans the first half of the positions, this process the second half.
    assert [planned[r] == here for r in ("0", "2", "4", "6")] == [False, False, True, True]


def test_a_failed_helper_leaves_its_positions_here(monkeypatch, tmp_path) -> None:
    parent = os.getpid()

    def fail_in_helper(rank: int) -> None:
        if os.getpid() != parent:
            raise RuntimeError("the helper breaks")

    alone = _summary(_plan(monkeypatch, 1))
    log_path = tmp_path / "planned.txt"
    helped = _summary(_plan(monkeypatch, 2, log_path, fail_in_helper))
    assert helped == alone
    planned = [line.split() for line in log_path.read_text().splitlines()]
    assert sorted(int(rank) for rank, _ in planned) == [0, 2, 4, 6]
    assert {pid for _, pid in planned} == {str(parent)}


def test_an_error_of_this_processs_positions_surfaces(monkeypatch) -> None:
    def fail_last(rank: int) -> None:
        if rank == 6:
            raise ValueError("position 4 cannot be planned")

    forked = []
    fork = os.fork

    def recording_fork() -> int:
        pid = fork()
        if pid:
            forked.append(pid)
        return pid

    monkeypatch.setattr(plan_workers.os, "fork", recording_fork)
    with pytest.raises(ValueError, match="position 4 cannot be planned"):
        _plan(monkeypatch, 2, fail=fail_last)
    assert len(forked) == 1
    with pytest.raises(ChildProcessError):
        os.waitpid(forked[0], os.WNOHANG)  # the helper was stopped and reaped
