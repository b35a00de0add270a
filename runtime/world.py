"""The planned world: what ``zeroc.world`` plans a job for, passed down instead of a global.

``zeroc.world.fake_world`` plans a job for a world that is not here by running zeroc's own
program on fake tensors. What that run must do differently is one ``PlannedWorld`` (frozen),
made once at the planner's entry and handed down explicitly: to ``zeroc.parallelize``
(``planned_world=``), which keeps it on the ``ZeroLayout`` every flat buffer carries, so the
compile path and the executors it builds read it from there. ``None`` everywhere means a real
run. Nothing here is read from a thread-local or module global.

``SharedPlanning`` is what the positions of one planned world share (``plan_world`` makes one
per world): the pipeline fronts, the reusable stage programs (``zeroc.pipeline.stage_reuse``),
whether the model was checked meta-initializable, and the front-only flag. Two worlds planned
one after the other own two holders, so neither sees the other's.

``StageRunner``: how the pipeline executor calls a stage graph, chosen once at its
construction from the world: ``RealRun`` (the graph itself) or ``FakeReplay`` (replayed on
fake tensors, ``zeroc.runtime.fake_replay``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zeroc.runtime import fake_replay

__all__ = ["FakeReplay", "PlannedWorld", "RealRun", "SharedPlanning", "StageRunner",
           "stage_runner"]


@dataclasses.dataclass
class SharedPlanning:
    """What a position of one planned world leaves for the next to take as it is."""

    # (key) -> PipelineFront, keyed by the shared trace's graph id, sizes, prefix and config
    fronts: dict[tuple, Any] = dataclasses.field(default_factory=dict)
    # id(graph) -> that graph: keeps the ids the fronts are keyed by unique while planning
    front_graphs: dict[int, Any] = dataclasses.field(default_factory=dict)
    # stage_reuse.signature -> the compiled StageProgram (and its records)
    stages: dict[tuple, Any] = dataclasses.field(default_factory=dict)
    # the model was checked meta-initializable once: its copies need no second check
    meta_initializable: bool = False
    # while plan_world builds the shared front: the pipeline compiler stops once it is made
    front_only: bool = False


@dataclasses.dataclass(frozen=True)
class PlannedWorld:
    """Rank ``rank`` of a ``world_size``-rank job with ``pp`` pipeline positions, planned on
    fake tensors of ``device``. ``simulated``: no device exists, so nothing is timed with
    CUDA events and stage graphs are replayed; ``skip_init``: meta models are allocated
    without running initializers (fake tensors hold no values). ``shared``: the holder of the
    world being planned (None when one position is planned alone)."""

    rank: int
    world_size: int
    pp: int
    device: torch.device
    simulated: bool = True
    skip_init: bool = True
    shared: SharedPlanning | None = dataclasses.field(default=None, compare=False)


class RealRun:
    """Calls each stage graph; every gradient is accumulated."""

    simulated = False

    def call(self, graph: Any, *args: Any) -> Any:
        """``graph(*args)``."""
        return graph(*args)

    def adds_nothing(self, held: torch.Tensor, grad: Any) -> bool:
        """A real gradient is always added."""
        return False


class FakeReplay(RealRun):
    """Replays stage graphs on fake tensors; skips additions that change no figure."""

    simulated = True

    def call(self, graph: Any, *args: Any) -> Any:
        """``graph(*args)`` once per input signature, then its recorded outputs."""
        return fake_replay.call(graph, *args)

    def adds_nothing(self, held: torch.Tensor, grad: Any) -> bool:
        """Whether adding ``grad`` into ``held`` allocates nothing (fake values are unread)."""
        return fake_replay.adds_nothing(held, grad)


StageRunner = RealRun  # the protocol: RealRun's methods


def stage_runner(world: PlannedWorld | None) -> RealRun:
    """The runner for ``world``: replay on a simulated world, the graphs themselves else."""
    return FakeReplay() if world is not None and world.simulated else RealRun()
