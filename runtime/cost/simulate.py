"""Timing simulation of a pipeline ``Schedule``: timelines, bubbles, activation peaks.

Each rank runs its compute actions in list order; an action starts when the rank is free and
its inputs exist:

- ``F(s, m)`` after ``F(s - 1, m)`` (plus the p2p latency when that ran on another rank);
- ``B(s, m)`` / ``I(s, m)`` after the backward (``B`` or ``I``) of ``(s + 1, m)``, or after
  ``F(s, m)`` for the last stage;
- ``W(s, m)`` after ``I(s, m)``;
- ``FB`` after the inputs of both halves; both halves finish when it ends.

P2p and collective actions of a lowered schedule take no time here (``p2p_latency`` models
the transfer on each cross-rank edge instead).

Bubble. ``bubble[r] = makespan - busy[r]``: the time rank ``r`` is not computing between the
step's start (0) and the end of the whole step (the last action on any rank). Every rank is
held for the whole step, so this is what a rank loses. It is the definition of the DualPipe
README's table: with F=1, B=2, W=1, F&B=3 on 8 ranks and 20 micro-batches it gives exactly
(PP-1)(F+B) = 21 on every rank for 1F1B, (PP-1)(F+B-2W) = 7 for ZB1P and (PP/2-1)(F&B+B-3W)
= 6 for DualPipe, and 6 for DualPipeV on PP/2 ranks (the same 8 stages). ``Timeline.bubble`` is
the largest per-rank value. (Idle time between a rank's first and last action would instead
give 0 on 1F1B's last rank: it starts late and ends early, yet is held for the whole step.)

Activations. Per rank, ``F`` holds one micro-batch's activations of its stage until the
backward frees them: ``B`` frees, ``I`` keeps them (the weight gradient still needs them),
``W`` frees; ``FB`` counts as its forward and then its backward. ``peak_held`` weighs each
micro-batch by what its stage holds (a V-shaped schedule's rank holds many micro-batches of
one stage and few of the other).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from zeroc.runtime.actions import Action, ActionKind, DataKey, Schedule, data_inputs, data_output


@dataclasses.dataclass(frozen=True)
class ActionCosts:
    """Duration of each compute kind, in any time unit.

    ``backward`` is the full backward ``B``; ``input`` (``I``) defaults to ``backward -
    weight``; ``overlapped`` (``FB``) defaults to ``forward + backward`` (no overlap gain).
    ``p2p_latency`` is added to every dependency that crosses ranks. ``stages``, when given,
    holds one ``(F, B, W)`` per stage and overrides the three kind-wide values for that stage
    (``I = B - W``; ``FB`` = its forward's ``F`` + its backward's ``B``).
    """

    forward: float = 1.0
    backward: float = 2.0
    weight: float = 1.0
    input: float | None = None
    overlapped: float | None = None
    p2p_latency: float = 0.0
    stages: tuple[tuple[float, float, float], ...] = ()

    def __post_init__(self) -> None:
        if any(v < 0 for costs in self.stages for v in costs) or any(
                w > b for _, b, w in self.stages):
            raise ValueError(f"ActionCosts.stages must hold (F, B, W) >= 0 with W <= B, got "
                             f"{self.stages}")
        for name in ("forward", "backward", "weight", "input", "overlapped", "p2p_latency"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"ActionCosts.{name} must be >= 0, got {value}")
        if self.input is None and self.weight > self.backward:
            raise ValueError(
                f"ActionCosts.weight ({self.weight}) exceeds backward ({self.backward}); "
                "give input explicitly"
            )

    def of(self, action: Action) -> float:
        """Duration of one compute action."""
        kind = action.kind
        if self.stages and action.is_compute:
            forward, backward, weight = self.stages[action.stage]
            if kind is ActionKind.F:
                return forward
            if kind is ActionKind.B:
                return backward
            if kind is ActionKind.W:
                return weight
            if kind is ActionKind.I:
                return backward - weight
            if kind is ActionKind.FB:
                return forward + self.stages[action.b_stage][1]
        if kind is ActionKind.F:
            return self.forward
        if kind is ActionKind.B:
            return self.backward
        if kind is ActionKind.W:
            return self.weight
        if kind is ActionKind.I:
            return self.backward - self.weight if self.input is None else self.input
        if kind is ActionKind.FB:
            return self.forward + self.backward if self.overlapped is None else self.overlapped
        raise ValueError(f"{action} is not a compute action")


@dataclasses.dataclass(frozen=True)
class TimedAction:
    """One compute action with its simulated start and end."""

    action: Action
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Result of ``simulate``: per-rank timed actions and summary numbers."""

    schedule_name: str
    ranks: tuple[tuple[TimedAction, ...], ...]
    makespan: float
    busy: tuple[float, ...]
    rank_bubbles: tuple[float, ...]
    peak_activations: tuple[int, ...]

    @property
    def bubble(self) -> float:
        """The largest per-rank bubble (idle time within the step)."""
        return max(self.rank_bubbles)

    def bubble_ratio(self, rank: int) -> float:
        """Rank ``rank``'s idle fraction of the step (0 for an empty step)."""
        return self.rank_bubbles[rank] / self.makespan if self.makespan else 0.0


def simulate(schedule: Schedule, costs: ActionCosts | None = None) -> Timeline:
    """Simulate ``schedule`` with ``costs`` (defaults: F=1, B=2, W=1).

    Raises ``ValueError`` if the schedule deadlocks (some rank waits for an input that no
    rank can produce).
    """
    costs = costs or ActionCosts()
    last_stage = schedule.num_stages - 1
    queues = [schedule.compute_actions(r) for r in range(schedule.num_ranks)]
    positions = [0] * schedule.num_ranks
    clocks = [0.0] * schedule.num_ranks
    ready: dict[DataKey, tuple[float, int]] = {}
    timed: list[list[TimedAction]] = [[] for _ in queues]

    def input_time(key: DataKey, rank: int) -> float | None:
        if key not in ready:
            return None
        when, where = ready[key]
        return when + (costs.p2p_latency if where != rank else 0.0)

    progress = True
    while progress:
        progress = False
        for rank, queue in enumerate(queues):
            while positions[rank] < len(queue):
                action = queue[positions[rank]]
                parts = action.parts()
                start = clocks[rank]
                inputs = [input_time(k, rank) for p in parts for k in data_inputs(p, last_stage)]
                if any(t is None for t in inputs):
                    break
                start = max([start, *inputs])
                end = start + costs.of(action)
                for part in parts:
                    ready[data_output(part)] = (end, rank)
                timed[rank].append(TimedAction(action, start, end))
                clocks[rank] = end
                positions[rank] += 1
                progress = True
    blocked = [str(q[p]) for q, p in zip(queues, positions, strict=True) if p < len(q)]
    if blocked:
        raise ValueError(f"schedule {schedule.name} deadlocks; ranks wait at: {', '.join(blocked)}")

    makespan = max(clocks, default=0.0)
    busy = tuple(sum(t.end - t.start for t in rank) for rank in timed)
    return Timeline(
        schedule_name=schedule.name,
        ranks=tuple(tuple(rank) for rank in timed),
        makespan=makespan,
        busy=busy,
        rank_bubbles=tuple(makespan - b for b in busy),
        peak_activations=tuple(peak_activations(q) for q in queues),
    )


def peak_activations(actions: tuple[Action, ...]) -> int:
    """The most micro-batch activations one rank holds at once while running ``actions``."""
    return peak_held(actions, lambda stage: 1)


def peak_held(actions: tuple[Action, ...], held: Callable[[int], int]) -> int:
    """The most one rank holds at once while running ``actions`` when a forward of stage
    ``s`` holds ``held(s)`` until its backward frees it (as ``peak_activations`` counts)."""
    live = peak = 0
    for action in actions:
        for part in action.parts():
            if part.kind is ActionKind.F:
                live += held(part.stage)
                peak = max(peak, live)
            elif part.kind in (ActionKind.B, ActionKind.W):
                live -= held(part.stage)
    return peak
