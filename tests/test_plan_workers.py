"""A planned world's positions are split with a forked helper process (two cores).

The plan must be the one planning every position in this process gives; the helper must
really plan its share (in another process), chosen by ``split_positions`` from each
position's estimated work so that no process compiles a program the other could have taken
whole; a helper that fails leaves its positions to this process, and an error of this
process's own positions surfaces as it would alone.
"""

from __future__ import annotations

import os

import pytest
import torch
from models.gpt import GPT, GPTConfig

import zeroc
import zeroc.world.plan_workers as plan_workers
import zeroc.world.world_plan as world_plan
from zeroc.world.plan_workers import PositionWork, split_positions


def _model() -> GPT:
    """One block per stage of the pp=4 plans (the middle two stages alike)."""
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32), seed=1)


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


def test_the_helper_plans_its_share_of_the_positions_to_the_same_plan(monkeypatch,
                                                                     tmp_path) -> None:
    alone = _summary(_plan(monkeypatch, 1))
    log_path = tmp_path / "planned.txt"
    works = []
    plan_positions = world_plan.plan_positions

    def spy(plan_one, positions, work=None):
        works.append(work)
        return plan_positions(plan_one, positions, work)

    monkeypatch.setattr(world_plan, "plan_positions", spy)
    helped = _summary(_plan(monkeypatch, 2, log_path))
    assert helped == alone
    planned = dict(line.split() for line in log_path.read_text().splitlines())
    assert sorted(int(rank) for rank in planned) == [0, 2, 4, 6]
    # Each position's work names the programs it compiles: the first stage, the middle
    # stages' one program (two positions), the last stage.
    (work,) = works
    programs = [tuple(key for key, _ in work[p].programs) for p in range(4)]
    assert programs[1] == programs[2] and len({programs[0], programs[1], programs[3]}) == 3
    theirs, mine = split_positions([0, 1, 2, 3], work)
    here = str(os.getpid())
    assert {p for p in range(4) if planned[str(2 * p)] != here} == set(theirs)
    assert {p for p in range(4) if planned[str(2 * p)] == here} == set(mine)


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


def _llama_work(pp: int) -> dict[int, PositionWork]:
    """1F1B on a Llama: three programs (first, middle, last); the ends a little larger."""
    work = {}
    for p in range(pp):
        program, size = (0, 120.0) if p == 0 else (2, 130.0) if p == pp - 1 else (1, 100.0)
        step = size * (1 + plan_workers.STEP_PER_MICROBATCH * 2 * pp)
        work[p] = PositionWork(((program, plan_workers.COMPILE_PER_NODE * size),), step)
    return work


def test_the_split_keeps_each_program_in_one_process_when_that_evens_the_work() -> None:
    # pp 8: the helper takes both ends, this process the six middle positions, so the middle
    # program is compiled once (halves would compile it in both processes).
    assert split_positions(list(range(8)), _llama_work(8)) == ([0, 7], [1, 2, 3, 4, 5, 6])
    # pp 4 and 16: dividing the middle positions evens the work better than keeping them.
    assert split_positions(list(range(4)), _llama_work(4)) == ([0, 1], [2, 3])
    theirs, mine = split_positions(list(range(16)), _llama_work(16))
    assert 0 in theirs and 15 in mine and len(theirs) == len(mine) == 8
    # Two positions: one each.
    assert split_positions([0, 1], _llama_work(2)) == ([0], [1])


def test_the_split_counts_a_program_once_per_process() -> None:
    # DualPipeV at pp 4: position 0 runs the first and the last stage, the others two middle
    # stages each (one program): position 0 alone weighs as much as the other three.
    work = {0: PositionWork(((0, 350.0), (2, 350.0)), 200.0)}
    work.update({p: PositionWork(((1, 350.0), (1, 350.0)), 200.0) for p in (1, 2, 3)})
    assert split_positions([0, 1, 2, 3], work) == ([0], [1, 2, 3])


def test_the_split_is_by_halves_without_work_or_with_too_many_groups() -> None:
    assert split_positions([0, 1, 2, 3, 4], None) == ([0, 1, 2], [3, 4])
    many = {p: PositionWork(((p, 350.0),), 100.0) for p in range(12)}  # 12 programs
    assert split_positions(list(range(12)), many) == (list(range(6)), list(range(6, 12)))


def test_plans_come_back_in_position_order_from_a_split_that_is_not_halves(
        monkeypatch) -> None:
    monkeypatch.setattr(plan_workers, "planning_cores", lambda: 2)
    parent = os.getpid()
    planned = plan_workers.plan_positions(lambda p: (p, os.getpid() == parent),
                                          list(range(8)), _llama_work(8))
    assert [p for p, _ in planned] == list(range(8))
    assert [p for p, here in planned if not here] == [0, 7]  # the helper's share


def test_planning_defers_only_full_collections_and_restores_the_thresholds(
        monkeypatch) -> None:
    import gc

    before = gc.get_threshold()
    seen = []
    plan_position = world_plan.plan_position

    def spy(*args, **kwargs):
        seen.append(gc.get_threshold())
        return plan_position(*args, **kwargs)

    monkeypatch.setattr(world_plan, "plan_position", spy)
    monkeypatch.setattr(plan_workers, "planning_cores", lambda: 1)
    tokens = torch.zeros(8, 16, dtype=torch.long)
    zeroc.explain(_model(), (tokens, tokens), world=8, pp=4, zero=3, device="cpu",
                  options={"schedule": "1f1b", "microbatches": 8})
    assert len(seen) == 4
    for thresholds in seen:  # young collections as before; no full one while planning
        assert thresholds[:2] == before[:2]
        assert thresholds[2] >= plan_workers._DEFERRED_FULL_THRESHOLD
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError), plan_workers.full_collections_deferred():
        raise RuntimeError("a failed plan")
    assert gc.get_threshold() == before
