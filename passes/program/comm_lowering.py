"""Insert point-to-point sends and receives into a compute-only pipeline schedule.

``lower_communication(schedule)`` adds, after every compute step whose output another rank
consumes, a ``SEND_F`` (forward output to the next stage's rank) or ``SEND_B`` (input gradient
to the previous stage's rank), and the matching ``RECV_F``/``RECV_B`` to the consumer's list.
Nothing is inserted when producer and consumer share a rank (DualPipeV's turn at the V).

Placement is a lock-step replay: in rounds, every rank places its next compute action once
the data it needs is on the rank; placing it appends its sends to its own list and the
matching receives to the consumers' lists at that same moment. All p2p pairs therefore sit
in one global order that every rank's list follows, which is why the result cannot deadlock
when each maximal run of p2p actions (a group: ``p2p_groups``) is posted as one batch of
isend/irecv and waited on: by induction over that order, when the first unfinished pair is
reached, everything before it on both ranks has finished, so both ranks post it. The same
order makes the sends on each (source, destination) channel match the receives one for one,
as torch.distributed's FIFO matching of same-tag messages requires. ``verify_p2p`` checks
both properties on any lowered schedule by replaying it with rendezvous semantics.

DualPipe's overlapped action ``FB`` (the forward of one micro-batch chunk with the backward of
another) is lowered as ``F``, its sends, ``B``, its sends (``split_overlapped``) when the
stage graphs hold no communication (``pp_reshard=False``, the default: ZeRO's collectives run
once per step outside them). Merging such graphs into one F&B graph overlaps nothing on one
stream; split, the forward chunk's sends are in flight while the backward chunk computes, and
the backward chunk waits for its received gradients only after the forward chunk computed.
Both halves are placed in the same lock-step round, so the consumers' receives land where they
did; the argument above holds for any compute schedule, so the result is deadlock-free too.
With ``pp_reshard=True`` the gathers and reductions are inside the stage graphs and ``FB``
stays one action, run as the interleaved F&B graph (``zeroc.passes.program.overlap_fb``).
"""

from __future__ import annotations

import dataclasses
from collections import deque

from zeroc.passes.base import PassContext, PassResult
from zeroc.runtime.actions import (
    Action,
    ActionKind,
    DataKey,
    Schedule,
    data_inputs,
    data_output,
    p2p_groups,  # the executor groups its actions the same way
)
from zeroc.runtime.program import Program


def _consumer(part: Action, schedule: Schedule) -> tuple[int, int] | None:
    """(consumer stage, its rank) of ``part``'s output, or ``None`` if nothing consumes it."""
    if part.kind is ActionKind.F and part.stage < schedule.num_stages - 1:
        stage = part.stage + 1
    elif part.kind in (ActionKind.B, ActionKind.I) and part.stage > 0:
        stage = part.stage - 1
    else:
        return None
    return stage, schedule.rank_of(stage, part.microbatch)


def _p2p_pair(part: Action, src: int, dst_stage: int, dst: int) -> tuple[Action, Action]:
    if part.kind is ActionKind.F:
        kinds = (ActionKind.SEND_F, ActionKind.RECV_F)
    else:
        kinds = (ActionKind.SEND_B, ActionKind.RECV_B)
    send = Action(kinds[0], part.stage, part.microbatch, peer=dst)
    recv = Action(kinds[1], dst_stage, part.microbatch, peer=src)
    return send, recv


def _needs(action: Action, last_stage: int) -> list[DataKey]:
    """Inputs of ``action`` that are not produced by ``action`` itself."""
    parts = action.parts() if action.is_compute else ()
    made = {data_output(p) for p in parts}
    return [k for p in parts for k in data_inputs(p, last_stage) if k not in made]


def lower_communication(schedule: Schedule, split_overlapped: bool = False) -> Schedule:
    """Return ``schedule`` with SEND_F/RECV_F/SEND_B/RECV_B actions inserted;
    ``split_overlapped``: every ``FB`` becomes ``F``, its sends, ``B``, its sends (module
    docstring).

    Collective actions already in the lists keep their place relative to the compute actions.
    Raises ``ValueError`` if the schedule already has p2p actions or cannot make progress.
    """
    if any(a.is_p2p for rank_actions in schedule.actions for a in rank_actions):
        raise ValueError(f"schedule {schedule.name} already has p2p actions")
    last_stage = schedule.num_stages - 1
    pending = [deque(rank_actions) for rank_actions in schedule.actions]
    lowered: list[list[Action]] = [[] for _ in pending]
    present: list[set[DataKey]] = [set() for _ in pending]
    while any(pending):
        progress = False
        for rank, queue in enumerate(pending):
            if not queue:
                continue
            action = queue[0]
            if not all(key in present[rank] for key in _needs(action, last_stage)):
                continue
            queue.popleft()
            split = split_overlapped and action.kind is ActionKind.FB
            if not split:
                lowered[rank].append(action)
            progress = True
            for part in action.parts() if action.is_compute else ():
                if split:
                    lowered[rank].append(part)
                present[rank].add(data_output(part))
                consumer = _consumer(part, schedule)
                if consumer is None or consumer[1] == rank:
                    continue
                send, recv = _p2p_pair(part, rank, *consumer)
                lowered[rank].append(send)
                lowered[consumer[1]].append(recv)
                present[consumer[1]].add(data_output(part))
        if not progress:
            stuck = ", ".join(f"rank {r}: {q[0]}" for r, q in enumerate(pending) if q)
            raise ValueError(f"schedule {schedule.name} cannot make progress at {stuck}")
    return schedule.replace_actions(tuple(tuple(rank_actions) for rank_actions in lowered))


def _channel_message(action: Action, rank: int) -> tuple[int, int, DataKey]:
    """(source rank, destination rank, value moved) of a p2p action on ``rank``."""
    if action.kind is ActionKind.SEND_F:
        return rank, action.peer, ("F", action.stage, action.microbatch)
    if action.kind is ActionKind.RECV_F:
        return action.peer, rank, ("F", action.stage - 1, action.microbatch)
    if action.kind is ActionKind.SEND_B:
        return rank, action.peer, ("G", action.stage, action.microbatch)
    return action.peer, rank, ("G", action.stage + 1, action.microbatch)


def verify_p2p(schedule: Schedule) -> None:
    """Replay a lowered schedule with blocking batched p2p and raise ``ValueError`` on error.

    Semantics: a rank posts its current group; a send and a receive match when both are
    posted and are the next message on their (source, destination) channel; a group finishes
    when all its messages matched. A compute action may run only once its inputs are on the
    rank. Errors: unmatched or mismatched sends and receives, a compute action missing an
    input, or a deadlock.
    """
    last_stage = schedule.num_stages - 1
    groups = [p2p_groups(rank_actions) for rank_actions in schedule.actions]
    sends: dict[tuple[int, int], list[DataKey]] = {}
    recvs: dict[tuple[int, int], list[DataKey]] = {}
    for rank, rank_actions in enumerate(schedule.actions):
        for action in rank_actions:
            if action.is_p2p:
                src, dst, value = _channel_message(action, rank)
                side = sends if action.kind in (ActionKind.SEND_F, ActionKind.SEND_B) else recvs
                side.setdefault((src, dst), []).append(value)
    for channel in sorted(set(sends) | set(recvs)):
        if sends.get(channel, []) != recvs.get(channel, []):
            raise ValueError(
                f"rank {channel[0]} -> rank {channel[1]}: sends {sends.get(channel, [])} "
                f"do not match receives {recvs.get(channel, [])} in order"
            )
    position = [0] * schedule.num_ranks
    matched: set[tuple[int, int, DataKey]] = set()
    present: list[set[DataKey]] = [set() for _ in groups]
    while any(position[r] < len(groups[r]) for r in range(schedule.num_ranks)):
        posted: dict[tuple[int, int, DataKey], set[int]] = {}
        for rank, rank_groups in enumerate(groups):
            if position[rank] < len(rank_groups) and rank_groups[position[rank]][0].is_p2p:
                for action in rank_groups[position[rank]]:
                    posted.setdefault(_channel_message(action, rank), set()).add(rank)
        matched.update(message for message, ranks in posted.items() if len(ranks) == 2)
        progress = False
        for rank, rank_groups in enumerate(groups):
            if position[rank] >= len(rank_groups):
                continue
            group = rank_groups[position[rank]]
            if not group[0].is_p2p:
                missing = [k for k in _needs(group[0], last_stage) if k not in present[rank]]
                if missing:
                    raise ValueError(f"rank {rank}: {group[0]} runs before receiving {missing}")
                present[rank].update(data_output(p) for p in group[0].parts()
                                     if group[0].is_compute)
                position[rank] += 1
                progress = True
                continue
            messages = [_channel_message(a, rank) for a in group]
            if all(m in matched for m in messages):
                for _src, dst, value in messages:
                    if dst == rank:
                        present[rank].add(value)
                position[rank] += 1
                progress = True
        if not progress:
            stuck = ", ".join(f"rank {r}: {groups[r][position[r]]}"
                              for r in range(schedule.num_ranks) if position[r] < len(groups[r]))
            raise ValueError(f"schedule {schedule.name} deadlocks with blocking p2p at {stuck}")


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of ``schedule`` in the same per-rank order (for ``torch.no_grad()``)."""
    return schedule.replace_actions(tuple(
        tuple(part for a in rank_actions for part in a.parts() if part.kind is ActionKind.F)
        for rank_actions in schedule.actions))


def comm_lowering(program: Program, ctx: PassContext) -> PassResult:
    """Program pass: the pipeline layout's schedules (training and ``no_grad``) become the
    program's compute schedule with its p2p actions (``lower_communication``); its ``FB``
    actions split unless ``pp_reshard=True`` (module docstring)."""
    if program.schedule is None or program.pipeline is None:  # pp = 1: autograd's schedule
        return PassResult(program, False)
    split = not ctx.config.pp_reshard  # the stage graphs hold no communication
    training = lower_communication(program.schedule, split_overlapped=split)
    forward = lower_communication(forward_only(program.schedule))
    pipeline = dataclasses.replace(program.pipeline, schedule=training, forward_schedule=forward)
    p2p = sum(a.is_p2p for actions in training.actions for a in actions)
    here = sum(a.is_p2p for a in training.actions[program.pipeline.position])
    stats: dict[str, object] = {"p2p_actions": p2p, "p2p_actions_here": here}
    overlapped = sum(a.kind is ActionKind.FB for a in program.schedule.actions[
        program.pipeline.position])
    if overlapped:
        stats["fb_split_here" if split else "fb_merged_here"] = overlapped
    return PassResult(dataclasses.replace(program, pipeline=pipeline), True, stats)
