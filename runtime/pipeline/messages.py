"""A pipeline step's messages on one rank: inboxes, the outbox and the p2p groups that move them.

A stage's forward hands its message to the next stage, its backward the gradients of its
inputs to the previous one (``deliver``): into that stage's inbox when this rank runs it, else
into the outbox, from which the schedule's ``SEND_F`` / ``SEND_B`` actions post it.

Each p2p group of the lowered schedule is issued, when the executor reaches it, as ONE
``batch_isend_irecv`` of all its sends and receives (``exchange``), and nothing is waited
there: a compute waits only for the receives it reads (``await_inputs``), the sends and any
unread receive at the end of the step (``end``). This is the order NCCL needs. NCCL runs a
pair of ranks' transfers on one stream in issue order, each waiting for its counterpart, so
receives posted one by one ahead of the sends they pair with (what gloo, which matches by
tag, accepts) deadlock there; groups issued whole, in the lowering's order
(``zeroc.passes.program.comm_lowering.verify_p2p``: deadlock-free as batched groups), cannot. The
transfers still overlap compute: a batch runs on the communication stream (or gloo's
threads) while the ranks compute, until the compute that reads it. ``zeroc.runtime.
nccl_order`` records what a step issues and waits for and plays NCCL's matching on it.

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

from zeroc.runtime import nccl_order
from zeroc.runtime.actions import Action, ActionKind
from zeroc.runtime.pipeline import abort as pipeline_abort
from zeroc.runtime.pipeline.p2p import post_batch

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


def plan_groups(groups: list[tuple[Action, ...]], train: bool,
                messages: tuple[tuple[str, ...], ...],
                values: dict[str, tuple[tuple[int, ...], torch.dtype, bool]],
                global_ranks: tuple[int, ...]) -> tuple[GroupPlan, ...]:
    """One ``GroupPlan`` per action group of this rank (see the module docstring)."""
    plans = []
    for group in groups:
        if not group[0].is_p2p:
            waits = []
            for part in group[0].parts():
                if part.kind is ActionKind.F:
                    waits.append(("F", part.stage, part.microbatch))
                elif part.kind in (ActionKind.B, ActionKind.I):
                    waits.append(("B", part.stage, part.microbatch))
            plans.append(GroupPlan(False, waits_for=tuple(waits)))
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
        # The step's batches not yet waited, by issue number: works, recorded transfers and
        # the sent tensors (kept alive until then). A work is waited exactly once: a second
        # wait on a finished gloo receive blocks for a message that never comes.
        self._batches: dict[int, tuple[list[Any], tuple[int, ...], list[torch.Tensor]]] = {}
        self._arriving: dict[MessageKey, int] = {}  # a received message -> its batch
        self._issued = 0

    def deliver(self, kind: str, stage: int, microbatch: int, message: dict[str, torch.Tensor],
                local: bool) -> None:
        """Give ``message`` to ``stage``: into its inbox (``local``) or the outbox."""
        if local:
            self.inbox[kind][(stage, microbatch)] = message
        else:
            self.outbox[(kind, stage, microbatch)] = list(message.values())

    def exchange(self, plan: GroupPlan) -> None:
        """Issue a p2p group: its sends and receives as one batch, waited later
        (module docstring); the received values land in the inboxes at once, and a compute
        waits for the ones it reads before using them."""
        sends = []
        for key, peer in plan.sends:
            tensors = [t.contiguous() for t in self.outbox.pop(key)]
            sends.append((tensors, peer, f"{key[0]}{key[2]}->s{key[1]}"))
        receives = []
        for receive in plan.receives:
            tensors = [torch.empty(shape, dtype=dtype, device=self.device)
                       for shape, dtype in receive.metas]
            key = (receive.inbox, *receive.key)
            receives.append((tensors, receive.peer, f"{key[0]}{key[2]}->s{key[1]}"))
            self.inbox[receive.inbox][receive.key] = dict(zip(receive.names, tensors,
                                                              strict=True))
        works, indices = post_batch(sends, receives)
        if not works:
            return
        self._issued += 1
        number = self._issued
        self._batches[number] = (works, indices, [t for ts, _, _ in sends for t in ts])
        for receive in plan.receives:  # one batch: a receive is done when the batch is
            self._arriving[(receive.inbox, *receive.key)] = number

    def _wait(self, number: int) -> None:
        batch = self._batches.pop(number, None)
        if batch is None:
            return  # waited already
        works, indices, _sent = batch
        for work in works:  # ends within seconds when a peer's step failed (pipeline_abort)
            pipeline_abort.wait(work, self.device, "a pipeline message")
        nccl_order.waited(indices)

    def await_inputs(self, plan: GroupPlan) -> None:
        """Wait for the receives a compute reads: its forward input, its output gradients."""
        for needed in plan.waits_for:
            number = self._arriving.pop(needed, None)
            if number is not None:
                self._wait(number)

    def end(self) -> None:
        """Wait for every batch of the step not waited yet (sends, receives nothing read)."""
        for number in list(self._batches):
            self._wait(number)
        self._arriving = {}
