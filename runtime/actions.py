"""Pipeline action IR: what each rank does, in order, for one training step.

An ``Action`` is one step of one rank: a compute step (``F``, ``I``, ``W``, ``B``, ``FB``), a
point-to-point transfer (``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``) or a collective on a
stage's parameters (``UNSHARD``, ``RESHARD``, ``REDUCE_GRAD``). A ``Schedule`` holds the
per-rank action tuples plus the stage placement. Both are immutable and round-trip through
plain dicts (JSON).

Conventions:

- ``F(s, m)`` runs stage ``s`` forward on micro-batch ``m``; ``B`` is its full backward;
  ``I`` the input-gradient half and ``W`` the weight-gradient half of that backward.
- ``FB`` overlaps ``F(stage, microbatch)`` with ``B(b_stage, b_microbatch)``; for data
  dependencies and activation memory it counts as the forward first, then the backward.
- ``SEND_F`` carries ``stage`` = the sending stage ``s`` and ``RECV_F`` the receiving stage
  ``s + 1``; ``SEND_B`` carries the sending stage ``s`` and ``RECV_B`` the receiving stage
  ``s - 1``. ``peer`` is the other rank; ``microbatch`` the micro-batch moved.
- A stage placed on two ranks (DualPipe) serves the first half of the micro-batches on its
  first rank and the second half on its second rank (see ``Schedule.rank_of``).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any


class ActionKind(str, enum.Enum):
    """What an action does; the value is the short name used in text and JSON."""

    F = "F"
    I = "I"  # noqa: E741 - the established name of the input-gradient backward
    W = "W"
    B = "B"
    FB = "FB"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.I, ActionKind.W, ActionKind.B, ActionKind.FB})
P2P_KINDS = frozenset(
    {ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B}
)
COLLECTIVE_KINDS = frozenset({ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD})

_PEER_ARROW = {
    ActionKind.SEND_F: "->",
    ActionKind.SEND_B: "->",
    ActionKind.RECV_F: "<-",
    ActionKind.RECV_B: "<-",
}
_ACTION_RE = re.compile(
    r"^(?P<kind>[A-Z_]+?)(?P<mb>\d+)?@s(?P<stage>\d+)(?:(?:->|<-)r(?P<peer>\d+))?$"
)


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of one rank. See the module docstring for the field conventions.

    ``b_stage``/``b_microbatch`` are set only for ``FB`` (its backward half); ``peer`` only
    for the p2p kinds; ``microbatch`` is ``None`` only for the collective kinds.
    """

    kind: ActionKind
    stage: int
    microbatch: int | None = None
    peer: int | None = None
    b_stage: int | None = None
    b_microbatch: int | None = None

    def __post_init__(self) -> None:
        kind = ActionKind(self.kind)
        object.__setattr__(self, "kind", kind)
        if self.stage < 0:
            raise ValueError(f"Action stage must be >= 0, got {self.stage}")
        has_mb = self.microbatch is not None
        if kind in COLLECTIVE_KINDS:
            if has_mb or self.peer is not None:
                raise ValueError(f"{kind.value} takes only a stage, got {self!r}")
        elif not has_mb or self.microbatch < 0:
            raise ValueError(f"{kind.value} needs a micro-batch >= 0, got {self.microbatch}")
        if (self.peer is not None) != (kind in P2P_KINDS):
            raise ValueError(f"peer is required for p2p kinds and only for them, got {self!r}")
        is_fb = kind is ActionKind.FB
        if is_fb != (self.b_stage is not None) or is_fb != (self.b_microbatch is not None):
            raise ValueError(f"b_stage/b_microbatch are required for FB and only FB: {self!r}")

    @property
    def is_compute(self) -> bool:
        """True for F, I, W, B and FB."""
        return self.kind in COMPUTE_KINDS

    @property
    def is_p2p(self) -> bool:
        """True for SEND_F, RECV_F, SEND_B and RECV_B."""
        return self.kind in P2P_KINDS

    def parts(self) -> tuple[Action, ...]:
        """The single-kind compute steps this action performs, in order (FB -> (F, B))."""
        if self.kind is ActionKind.FB:
            return (
                Action(ActionKind.F, self.stage, self.microbatch),
                Action(ActionKind.B, self.b_stage, self.b_microbatch),
            )
        return (self,)

    def short(self) -> str:
        """A compact label without the stage: ``F3``, ``B1``, ``W2``, ``F4&B0``, ``SEND_F3``."""
        if self.kind is ActionKind.FB:
            return f"F{self.microbatch}&B{self.b_microbatch}"
        if self.microbatch is None:
            return f"{self.kind.value}"
        return f"{self.kind.value}{self.microbatch}"

    def __str__(self) -> str:
        if self.kind is ActionKind.FB:
            return f"F{self.microbatch}@s{self.stage}&B{self.b_microbatch}@s{self.b_stage}"
        text = f"{self.short()}@s{self.stage}"
        if self.peer is not None:
            text += f"{_PEER_ARROW[self.kind]}r{self.peer}"
        return text

    @staticmethod
    def parse(text: str) -> Action:
        """Inverse of ``str(action)``: ``"F3@s1"``, ``"F4@s0&B0@s7"``, ``"SEND_F3@s1->r2"``."""
        if "&" in text:
            fwd, bwd = (Action.parse(part) for part in text.split("&", 1))
            if fwd.kind is not ActionKind.F or bwd.kind is not ActionKind.B:
                raise ValueError(f"An overlapped action must read 'F..&B..', got {text!r}")
            return Action(ActionKind.FB, fwd.stage, fwd.microbatch,
                          b_stage=bwd.stage, b_microbatch=bwd.microbatch)
        match = _ACTION_RE.match(text.strip())
        if match is None or match["kind"] not in ActionKind.__members__:
            raise ValueError(f"Cannot parse action {text!r}; expected e.g. 'F3@s1'")
        mb, peer = match["mb"], match["peer"]
        return Action(ActionKind(match["kind"]), int(match["stage"]),
                      None if mb is None else int(mb), None if peer is None else int(peer))

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form; fields that are ``None`` are left out."""
        out: dict[str, Any] = {"kind": self.kind.value, "stage": self.stage}
        for name in ("microbatch", "peer", "b_stage", "b_microbatch"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Action:
        """Inverse of ``to_dict``."""
        return Action(**data)


def forward(stage: int, microbatch: int) -> Action:
    """``F(stage, microbatch)``."""
    return Action(ActionKind.F, stage, microbatch)


def backward(stage: int, microbatch: int) -> Action:
    """``B(stage, microbatch)``: the full backward."""
    return Action(ActionKind.B, stage, microbatch)


def backward_input(stage: int, microbatch: int) -> Action:
    """``I(stage, microbatch)``: the input-gradient half of the backward."""
    return Action(ActionKind.I, stage, microbatch)


def backward_weight(stage: int, microbatch: int) -> Action:
    """``W(stage, microbatch)``: the weight-gradient half of the backward."""
    return Action(ActionKind.W, stage, microbatch)


def overlapped(f_stage: int, f_microbatch: int, b_stage: int, b_microbatch: int) -> Action:
    """``FB``: forward of ``(f_stage, f_microbatch)`` overlapped with a full backward."""
    return Action(ActionKind.FB, f_stage, f_microbatch, b_stage=b_stage, b_microbatch=b_microbatch)


# A value that flows between actions: ("F", s, m) is stage s's forward output for micro-batch
# m, ("G", s, m) the gradient of stage s's input (from its B or I), ("W", s, m) a finished W.
DataKey = tuple[str, int, int]


def data_output(part: Action) -> DataKey:
    """What finishing the single-kind compute step ``part`` makes available."""
    tags = {ActionKind.F: "F", ActionKind.B: "G", ActionKind.I: "G", ActionKind.W: "W"}
    if part.kind not in tags:
        raise ValueError(f"{part} is not a single-kind compute step (F, I, W or B)")
    return (tags[part.kind], part.stage, part.microbatch)


def data_inputs(part: Action, last_stage: int) -> list[DataKey]:
    """What the single-kind compute step ``part`` needs before it can start.

    ``F(s, m)`` needs ``F(s - 1, m)``; ``B``/``I`` of ``(s, m)`` need ``F(s, m)`` and the input
    gradient from ``(s + 1, m)`` (from ``F(s, m)`` alone on the last stage); ``W`` needs its ``I``.
    """
    stage, mb = part.stage, part.microbatch
    if part.kind is ActionKind.F:
        return [("F", stage - 1, mb)] if stage > 0 else []
    if part.kind is ActionKind.W:
        return [("G", stage, mb)]
    if part.kind not in (ActionKind.B, ActionKind.I):
        raise ValueError(f"{part} is not a single-kind compute step (F, I, W or B)")
    upstream = ("F", stage, mb) if stage == last_stage else ("G", stage + 1, mb)
    return [("F", stage, mb), upstream]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: per-rank action tuples plus where every stage lives.

    ``placement[s]`` is the tuple of ranks holding stage ``s`` (two ranks for DualPipe).
    ``actions[r]`` is rank ``r``'s actions in execution order.
    """

    name: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    placement: tuple[tuple[int, ...], ...]
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        if len(self.placement) != self.num_stages:
            raise ValueError(
                f"placement has {len(self.placement)} entries for {self.num_stages} stages"
            )
        if len(self.actions) != self.num_ranks:
            raise ValueError(f"actions has {len(self.actions)} ranks, expected {self.num_ranks}")
        for stage, ranks in enumerate(self.placement):
            if not ranks or any(not 0 <= r < self.num_ranks for r in ranks):
                raise ValueError(f"stage {stage} placed on invalid ranks {ranks}")

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The rank that runs ``stage`` for ``microbatch``.

        A stage on ``k`` ranks serves micro-batch ``m`` on replica ``m * k // N``: the first
        half of the micro-batches on the first rank, the second half on the second.
        """
        ranks = self.placement[stage]
        return ranks[microbatch * len(ranks) // self.num_microbatches]

    def compute_actions(self, rank: int) -> tuple[Action, ...]:
        """Rank ``rank``'s compute actions only (no p2p, no collectives)."""
        return tuple(a for a in self.actions[rank] if a.is_compute)

    def replace_actions(self, actions: tuple[tuple[Action, ...], ...]) -> Schedule:
        """A copy of this schedule with other per-rank actions."""
        return dataclasses.replace(self, actions=tuple(tuple(a) for a in actions))

    def __str__(self) -> str:
        lines = [
            f"schedule {self.name}: ranks={self.num_ranks} stages={self.num_stages} "
            f"microbatches={self.num_microbatches}"
        ]
        for rank, rank_actions in enumerate(self.actions):
            lines.append(f"  rank {rank}: " + " ".join(str(a) for a in rank_actions))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts, lists and ints only (JSON-ready)."""
        return {
            "name": self.name,
            "num_ranks": self.num_ranks,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "placement": [list(ranks) for ranks in self.placement],
            "actions": [[a.to_dict() for a in rank_actions] for rank_actions in self.actions],
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Schedule:
        """Inverse of ``to_dict``."""
        return Schedule(
            name=data["name"],
            num_ranks=data["num_ranks"],
            num_stages=data["num_stages"],
            num_microbatches=data["num_microbatches"],
            placement=tuple(tuple(ranks) for ranks in data["placement"]),
            actions=tuple(
                tuple(Action.from_dict(a) for a in rank_actions) for rank_actions in data["actions"]
            ),
        )


def check_compute_schedule(schedule: Schedule) -> None:
    """Raise ``ValueError`` unless every (stage, micro-batch) is computed exactly once.

    Each pair needs one forward and one backward (``B``, the ``B`` half of an ``FB``, or an
    ``I`` followed later on the same rank by its ``W``), all on ``schedule.rank_of``'s rank,
    with the forward before the backward.
    """
    seen: dict[tuple[ActionKind, int, int], int] = {}
    for rank, rank_actions in enumerate(schedule.actions):
        for position, action in enumerate(rank_actions):
            for part in action.parts() if action.is_compute else ():
                if not 0 <= part.stage < schedule.num_stages:
                    raise ValueError(f"rank {rank}: {part} names a stage out of range")
                if not 0 <= part.microbatch < schedule.num_microbatches:
                    raise ValueError(f"rank {rank}: {part} names a micro-batch out of range")
                expected = schedule.rank_of(part.stage, part.microbatch)
                if expected != rank:
                    raise ValueError(f"{part} is on rank {rank}, its stage is placed on {expected}")
                key = (part.kind, part.stage, part.microbatch)
                if key in seen:
                    raise ValueError(f"rank {rank}: {part} appears twice")
                seen[key] = position
    for stage in range(schedule.num_stages):
        for mb in range(schedule.num_microbatches):
            where = {kind: seen.get((kind, stage, mb)) for kind in (ActionKind.F, ActionKind.B,
                                                                   ActionKind.I, ActionKind.W)}
            fwd, full, inp, wgt = where.values()
            if fwd is None:
                raise ValueError(f"stage {stage} micro-batch {mb} has no forward")
            if (full is None) == (inp is None):
                raise ValueError(f"stage {stage} micro-batch {mb} needs exactly one of B or I")
            if (inp is None) != (wgt is None):
                raise ValueError(f"stage {stage} micro-batch {mb}: an I needs a W and vice versa")
            first_backward = full if full is not None else inp
            if first_backward < fwd or (wgt is not None and wgt < inp):
                raise ValueError(f"stage {stage} micro-batch {mb}: backward runs before its input")


def p2p_groups(rank_actions: tuple[Action, ...]) -> tuple[tuple[Action, ...], ...]:
    """Split one rank's actions into groups: each maximal run of p2p actions is one group
    (posted together, then waited on); every other action is a group of its own."""
    groups: list[list[Action]] = []
    for action in rank_actions:
        if action.is_p2p and groups and groups[-1][0].is_p2p:
            groups[-1].append(action)
        else:
            groups.append([action])
    return tuple(tuple(g) for g in groups)
