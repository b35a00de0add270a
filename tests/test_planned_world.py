"""The planned world is passed down, never read from a global (``zeroc.runtime.world``).

An AST scan finds no module of the package that names a global planning state, and finds the
executors and compilers taking the world (or a strategy chosen from it) at construction.
The stage runner and the group device are chosen from the world and the process group. Two
worlds planned one after the other in one process (different devices, world sizes) each get
their own ``SharedPlanning``: the second sees none of the first's fronts or stages. Planning
leaves the process's ``sys.excepthook`` as it was (no planned rank's prefix on a traceback),
and an error raised while a rank is planned names that rank once.
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from models.gpt import GPT, GPTConfig
from torch import nn

import zeroc
import zeroc.world.plan_workers as plan_workers
import zeroc.world.world_plan as world_plan
from zeroc.frontend.stage_compiler import StageCompiler
from zeroc.runtime import mesh
from zeroc.runtime.pipeline.executor import PipelineExecutor
from zeroc.runtime.world import FakeReplay, PlannedWorld, RealRun, SharedPlanning, stage_runner
from zeroc.world.fake_world import fake_world, meta_copy, planned_world

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("compiler", "passes", "codegen", "runtime")


def _modules() -> list[Path]:
    return [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]


def test_no_module_reads_a_global_planning_state() -> None:
    assert not (ROOT / "runtime" / "planning_state.py").exists()
    readers = []
    for path in _modules():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == "PLANNING":
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and "planning_state" in (node.module or ""):
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr == "PLANNING":
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not readers, readers
    assert len(_modules()) > 100  # the scan saw the package


def test_the_executors_take_the_world_at_construction() -> None:
    assert "planned" in inspect.signature(PipelineExecutor.__init__).parameters
    assert "planned" in {f.name for f in StageCompiler.__dataclass_fields__.values()}
    import zeroc.sharding.parallelize as parallelize

    assert "planned_world" in inspect.signature(parallelize.parallelize).parameters
    # the executor's hot path calls the runner it was given, no module-level switch
    source = inspect.getsource(PipelineExecutor)
    assert "self._runner.call(" in source and "stage_runner(planned)" in source


def test_the_stage_runner_is_chosen_from_the_world() -> None:
    world = PlannedWorld(rank=0, world_size=2, pp=1, device=torch.device("cpu"))
    assert type(stage_runner(world)) is FakeReplay and stage_runner(world).simulated
    assert type(stage_runner(None)) is RealRun and not stage_runner(None).simulated
    real = PlannedWorld(rank=0, world_size=2, pp=1, device=torch.device("cpu"), simulated=False)
    assert type(stage_runner(real)) is RealRun
    assert RealRun().call(lambda a, b: a + b, 1, 2) == 3


def test_the_group_device_is_read_from_the_fake_groups_configuration() -> None:
    """A planned world's fake group is configured for the devices the planned job's group
    serves, as a real one is: no table beside it says where its tensors live."""
    with fake_world(0, 2, 1, "cuda"):
        assert mesh.is_fake_group(dist.group.WORLD)
        assert dist.get_backend_config() == "cpu:fake,cuda:fake"
        assert mesh.group_device() == torch.device("cuda", 0)
    with fake_world(0, 2, 1, "cpu"):
        assert dist.get_backend_config() == "cpu:fake"
        assert mesh.group_device() == torch.device("cpu")
    assert not dist.is_initialized()
    assert mesh.group_device() == torch.device("cpu")
    assert not hasattr(mesh, "_PLANNED_DEVICES") and not hasattr(mesh, "plan_group_on")


def test_the_layout_carries_the_world_parallelize_was_given() -> None:
    gpt = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32), seed=1)
    world = planned_world(1, 4, 2, "cuda", SharedPlanning())
    with fake_world(1, 4, 2, "cuda"):
        model = zeroc.parallelize(meta_copy(gpt), zero=3, pp=2, planned_world=world)
        layout = model._zeroc_layout
        assert layout.planned is world and layout.planned.device == torch.device("cuda", 0)
        assert world.shared.meta_initializable  # checked once for the world's copies
        flat = model.__dict__["_zeroc_state"].params[0].flat
        assert flat._zeroc_layout.planned is world  # what the backend reads


@pytest.mark.slow
def test_two_worlds_planned_in_turn_share_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    holders: list[SharedPlanning] = []

    def recorded() -> SharedPlanning:
        holders.append(SharedPlanning())
        return holders[-1]

    monkeypatch.setattr(world_plan, "SharedPlanning", recorded)
    monkeypatch.setattr(plan_workers, "planning_cores", lambda: 1)  # the holders stay here
    gpt = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32), seed=1)
    tokens = torch.zeros(8, 16, dtype=torch.long)
    first = zeroc.explain(gpt, (tokens, tokens), world=4, pp=2, device="cpu")
    fronts = dict(holders[0].fronts)
    stages = dict(holders[0].stages)
    second = zeroc.explain(gpt, (tokens, tokens), world=8, pp=2, device="cuda")
    assert len(holders) == 2 and holders[0] is not holders[1]
    assert fronts and stages  # the first world shared its front and stages
    assert holders[1].stages  # the second compiled (and shared) its own stages
    assert holders[0].fronts == fronts and holders[0].stages == stages  # left as it was
    firsts = {id(f) for f in fronts.values()} | {id(s) for s in stages.values()}
    seconds = {id(f) for f in holders[1].fronts.values()} | {
        id(s) for s in holders[1].stages.values()}
    assert not firsts & seconds
    assert not holders[0].front_only and not holders[1].front_only
    assert (first.meta.world_size, first.meta.device) == (4, "cpu")
    assert (second.meta.world_size, second.meta.device) == (8, "cuda (planned)")


class _ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        return out.square().mean() if out.sum().item() > 0 else out.mean()


def test_planning_leaves_one_rank_prefix_at_most(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    """``init_process_group`` wraps ``sys.excepthook`` to put ``[rank<r>]: `` before every
    line of an uncaught traceback; a world planned position by position wrapped it once per
    fake group (the front and each position: ``[rank6]: [rank4]: [rank2]: [rank0]: [rank0]:``).
    Planning now leaves the process's own hook: a traceback printed afterwards carries no
    planned rank's prefix, and an error raised while a rank is planned names it in a note."""
    monkeypatch.setattr(plan_workers, "planning_cores", lambda: 1)  # every position here
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    gpt = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32), seed=1)
    tokens = torch.zeros(8, 16, dtype=torch.long)
    zeroc.explain(gpt, (tokens, tokens), world=8, pp=4, device="cpu")
    assert sys.excepthook is sys.__excepthook__
    try:
        raise RuntimeError("after planning")
    except RuntimeError as error:
        sys.excepthook(type(error), error, error.__traceback__)
    printed = capsys.readouterr().err
    assert "RuntimeError: after planning" in printed and "[rank" not in printed, printed
    with pytest.raises(ValueError, match="reads a tensor's value") as raised:
        zeroc.explain(_ReadsAValue(), (torch.ones(4, 8),), world=2, zero=3, device="cpu")
    assert raised.value.__notes__ == ["zeroc: raised while planning rank 0 of 2 (pp=1)"]
    assert sys.excepthook is sys.__excepthook__
