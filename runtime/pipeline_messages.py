"""A pipeline step's messages on one rank: inboxes, the outbox and the p2p groups that move them.

A stage's forward hands its message to the next stage, its backward the gradients of its
inputs to the previous one (``deliver``): into that stage's inbox when this rank runs it, else
into the outbox, from which the schedule's ``SEND_F`` / ``SEND_B`` actions post it. A p2p group
of the lowered schedule posts its sends when the executor reaches it (waited only at the end
of the step) and its receives before the compute that precedes it (``post``); the received
values land in the inboxes at the group, and a compute waits only for the receives it reads
(``await_inputs``, see ``runtime/p2p.py`` for why this order cannot deadlock).

What every step does the same way is worked out once, when the executor is built
(``plan_groups``): each p2p group's sends (outbox key, peer's global rank) and receives (inbox,
value names, shapes, dtypes, peer), and each compute's receives to wait for. In a forward-only
step (``torch.no_grad()``) the gradient transfers are left out.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from zeroc.runtime.actions import Action, ActionKind
from zeroc.runtime.p2p import post_receives, post_sends

__all__ = ["GroupPlan", "StepMessages", "plan_groups"]

log = logging.getLogger(__name__)

MessageKey = tuple[str, int, int]  # ("F" | "B", receiving stage, micro-batch)


@dataclasses.dataclass(frozen=True)
class Receive:
    """One message a p2p group receives: into ``inbox`` ("F" or "B") at ``(stage, mb)``."""

    inbox: str
    key: tuple[int, int]
    names: tuple[str, ...]
    metas: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    peer: int


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """What one action group does with messages, every step."""

    p2p: bool
    sends: tuple[tuple[MessageKey, int], ...] = ()  # (outbox key, peer's global rank)
    receives: tuple[Receive, ...] = ()
    waits_for: tuple[MessageKey, ...] = ()  # a compute: the receives it reads
    post_next: bool = False  # a compute followed by a p2p group: post its receives first


def plan_groups(groups: list[tuple[Action, ...]], train: bool,
                messages: tuple[tuple[str, ...], ...],
                values: dict[str, tuple[tuple[int, ...], torch.dtype, bool]],
                global_ranks: tuple[int, ...]) -> tuple[GroupPlan, ...]:
    """One ``GroupPlan`` per action group of this rank (see the module docstring)."""
    plans = []
    for position, group in enumerate(groups):
        if not group[0].is_p2p:
            waits = []
            for part in group[0].parts():
                if part.kind is ActionKind.F:
                    waits.append(("F", part.stage, part.microbatch))
                elif part.kind in (ActionKind.B, ActionKind.I):
                    waits.append(("B", part.stage, part.microbatch))
            following = position + 1 < len(groups) and groups[position + 1][0].is_p2p
            plans.append(GroupPlan(False, waits_for=tuple(waits), post_next=following))
            continue
        sends, receives = [], []
        for action in group:
            if not train and action.kind in (ActionKind.SEND_B, ActionKind.RECV_B):
                continue
            peer = global_ranks[action.peer]
            if action.kind is ActionKind.SEND_F:
                sends.append((("F", action.stage + 1, action.microbatch), peer))
            elif action.kind is ActionKind.SEND_B:
                sends.append((("B", action.stage - 1, action.microbatch), peer))
            else:
                forward = action.kind is ActionKind.RECV_F
                names = (messages[action.stage - 1] if forward
                         else tuple(k for k in messages[action.stage] if values[k][2]))
                receives.append(Receive("F" if forward else "B",
                                        (action.stage, action.microbatch), tuple(names),
                                        tuple(values[k][:2] for k in names), peer))
        plans.append(GroupPlan(True, tuple(sends), tuple(receives)))
    return tuple(plans)


class StepMessages:
    """One rank's messages in one step; ``begin`` starts a step, ``end`` waits what is left."""

    def __init__(self) -> None:
        self.begin(torch.device("cpu"))

    def begin(self, device: torch.device) -> None:
        """Start a step whose receive buffers live on ``device``."""
        self.device = device
        self.inbox: dict[str, dict[tuple[int, int], dict[str, torch.Tensor]]] = {"F": {}, "B": {}}
        self.outbox: dict[MessageKey, list[torch.Tensor]] = {}
        self._posted: dict[int, list[tuple[Receive, list[torch.Tensor], list[Any]]]] = {}
        self._arriving: dict[MessageKey, list[Any]] = {}
        self._sends: list[tuple[Any, torch.Tensor]] = []

    def deliver(self, kind: str, stage: int, microbatch: int, message: dict[str, torch.Tensor],
                local: bool) -> None:
        """Give ``message`` to ``stage``: into its inbox (``local``) or the outbox."""
        if local:
            self.inbox[kind][(stage, microbatch)] = message
        else:
            self.outbox[(kind, stage, microbatch)] = list(message.values())

    def post(self, position: int, plan: GroupPlan) -> None:
        """Post the receives of p2p group ``position`` (once per step)."""
        if position in self._posted:
            return
        posted = []
        for receive in plan.receives:
            tensors = [torch.empty(shape, dtype=dtype, device=self.device)
                       for shape, dtype in receive.metas]
            posted.append((receive, tensors, post_receives(tensors, receive.peer)))
        self._posted[position] = posted

    def exchange(self, position: int, plan: GroupPlan) -> None:
        """Post this group's sends (waited at the end of the step) and its receives, if not
        yet; the received values land in the inboxes, a compute waits for them before use."""
        for key, peer in plan.sends:
            tensors = [t.contiguous() for t in self.outbox.pop(key)]
            self._sends.extend(zip(post_sends(tensors, peer), tensors, strict=True))
        self.post(position, plan)
        for receive, tensors, works in self._posted.pop(position):
            self.inbox[receive.inbox][receive.key] = dict(zip(receive.names, tensors,
                                                              strict=True))
            if works:
                self._arriving[(receive.inbox, *receive.key)] = works

    def await_inputs(self, plan: GroupPlan) -> None:
        """Wait for the receives a compute reads: its forward input, its output gradients."""
        for needed in plan.waits_for:
            for work in self._arriving.pop(needed, ()):
                work.wait()

    def end(self) -> None:
        """Wait for messages nothing read (forward-only: gradients) and for every send."""
        for works in self._arriving.values():
            for work in works:
                work.wait()
        for work, _tensor in self._sends:
            work.wait()
        self._arriving = {}
        self._sends = []
