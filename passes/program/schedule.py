"""Pipeline schedules as per-rank compute action lists.

``build_schedule(name, num_ranks, num_microbatches)`` returns a ``Schedule`` holding only
compute actions (F, I, W, B, FB); ``zeroc.passes.program.comm_lowering`` adds the p2p actions.

Schedules and placements:

- ``gpipe``: all forwards, then all backwards. Stage ``r`` on rank ``r``.
- ``1f1b``: rank ``r`` runs ``min(P - 1 - r, N)`` warm-up forwards, then alternates one
  forward and one backward, then drains the backwards. Any ``N >= 1`` works (the reference
  implementation in torch.distributed.pipelining asks for ``N >= P``; we do not).
- ``zb1p``: ZB-H1 from the zero-bubble paper: 1F1B with every backward split into ``I`` and
  ``W``; rank ``r`` holds back its first ``r`` weight gradients, which fill the drain bubble,
  keeping 1F1B's peak of ``P`` activations. Any ``N >= 1``.
- ``dualpipev``: ``2P`` stages, rank ``r`` holds stages ``r`` and ``2P - 1 - r`` (a V);
  DeepSeek's eight-step order; needs ``N >= 2P``.
- ``dualpipe``: ``P`` stages, stage ``s`` on ranks ``s`` and ``P - 1 - s``; micro-batches
  ``0 .. N/2 - 1`` enter at rank 0 and flow to rank ``P - 1``, micro-batches ``N/2 .. N - 1``
  enter at rank ``P - 1`` and flow back. Rank ``r`` runs exactly DualPipeV(P/2, N/2)'s order of
  rank ``min(r, P - 1 - r)``; needs ``P`` even and ``N`` even with ``N >= 2P``.
"""

from __future__ import annotations

from collections import deque

from zeroc.runtime.actions import (
    Action,
    Schedule,
    backward,
    backward_input,
    backward_weight,
    check_compute_schedule,
    forward,
    overlapped,
)

SCHEDULE_NAMES = ("gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev")


def build_schedule(name: str, num_ranks: int, num_microbatches: int) -> Schedule:
    """Build the compute-only schedule ``name`` for ``num_ranks`` ranks and micro-batches.

    Raises ``ValueError`` for an unknown name or sizes the schedule cannot run.
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"Unknown schedule {name!r}; known schedules: {', '.join(SCHEDULE_NAMES)}")
    for option, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{option} must be an integer >= 1, got {value!r}")
    if name == "dualpipev" and num_microbatches < 2 * num_ranks:
        raise ValueError(
            f"dualpipev needs num_microbatches >= 2 * num_ranks (its number of stages): "
            f"got num_microbatches={num_microbatches} for num_ranks={num_ranks}"
        )
    if name == "dualpipe":
        if num_ranks % 2:
            raise ValueError(f"dualpipe needs an even num_ranks, got {num_ranks}")
        if num_microbatches % 2 or num_microbatches < 2 * num_ranks:
            raise ValueError(
                f"dualpipe needs an even num_microbatches >= 2 * num_ranks "
                f"(= {2 * num_ranks}), got {num_microbatches}"
            )
    builder = {
        "gpipe": _gpipe,
        "1f1b": _one_f_one_b,
        "zb1p": _zero_bubble_h1,
        "dualpipe": _dualpipe,
        "dualpipev": _dualpipev,
    }[name]
    schedule = builder(num_ranks, num_microbatches)
    check_compute_schedule(schedule)
    return schedule


def _linear(name: str, num_ranks: int, num_microbatches: int,
            actions: list[list[Action]]) -> Schedule:
    return Schedule(
        name=name,
        num_ranks=num_ranks,
        num_stages=num_ranks,
        num_microbatches=num_microbatches,
        placement=tuple((r,) for r in range(num_ranks)),
        actions=tuple(tuple(a) for a in actions),
    )


def _gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    mbs = range(num_microbatches)
    actions = [[forward(r, m) for m in mbs] + [backward(r, m) for m in mbs]
               for r in range(num_ranks)]
    return _linear("gpipe", num_ranks, num_microbatches, actions)


def _one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    actions = []
    for rank in range(num_ranks):
        warmup = min(num_ranks - 1 - rank, num_microbatches)
        ops = [forward(rank, m) for m in range(warmup)]
        for m in range(warmup, num_microbatches):
            ops += [forward(rank, m), backward(rank, m - warmup)]
        ops += [backward(rank, m) for m in range(num_microbatches - warmup, num_microbatches)]
        actions.append(ops)
    return _linear("1f1b", num_ranks, num_microbatches, actions)


def _zero_bubble_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    actions = []
    for rank in range(num_ranks):
        warmup = min(num_ranks - 1 - rank, num_microbatches)
        ops = [forward(rank, m) for m in range(warmup)]
        for step in range(num_microbatches):
            if step + warmup < num_microbatches:
                ops.append(forward(rank, step + warmup))
            ops.append(backward_input(rank, step))
            # Rank r runs each W r steps after its I: the held-back Ws fill the drain bubble.
            if step >= rank:
                ops.append(backward_weight(rank, step - rank))
        ops += [backward_weight(rank, m)
                for m in range(max(num_microbatches - rank, 0), num_microbatches)]
        actions.append(ops)
    return _linear("zb1p", num_ranks, num_microbatches, actions)


def _dualpipev_rank(num_ranks: int, num_microbatches: int, rank: int) -> list[Action]:
    """DeepSeek's DualPipeV order for ``rank``; phase 0 is stage ``rank``, phase 1 the other."""
    stages = (rank, 2 * num_ranks - 1 - rank)
    next_forward = [0, 0]
    next_backward = [0, 0]
    pending_weights: deque[tuple[int, int]] = deque()
    ops: list[Action] = []

    def take_forward(phase: int) -> tuple[int, int]:
        next_forward[phase] += 1
        return stages[phase], next_forward[phase] - 1

    def take_backward(phase: int) -> tuple[int, int]:
        next_backward[phase] += 1
        return stages[phase], next_backward[phase] - 1

    def f(phase: int) -> None:
        ops.append(forward(*take_forward(phase)))

    def b(phase: int, split: bool = False) -> None:
        stage, mb = take_backward(phase)
        if split:
            ops.append(backward_input(stage, mb))
            pending_weights.append((stage, mb))
        else:
            ops.append(backward(stage, mb))

    def w() -> None:
        if pending_weights:
            ops.append(backward_weight(*pending_weights.popleft()))

    def fb(f_phase: int, b_phase: int) -> None:
        ops.append(overlapped(*take_forward(f_phase), *take_backward(b_phase)))

    last = num_ranks - 1
    for _ in range(2 * (last - rank)):                       # step 1: F0
        f(0)
    for _ in range(rank + 1):                                # step 2: F0 F1
        f(0)
        f(1)
    for _ in range(last - rank):                             # step 3: I1 W F1
        b(1, split=True)
        w()
        f(1)
    for i in range(num_microbatches - 2 * num_ranks + rank + 1):   # step 4: F0&B1 F1&B0
        if i == 0 and rank == last:
            f(0)                                             # the V's turn: no overlap
            b(1)
        else:
            fb(0, 1)
        fb(1, 0)
    for _ in range(last - rank):                             # step 5: B1 F1&B0
        b(1)
        fb(1, 0)
    split = False
    half = (rank + 1) // 2
    for i in range(rank + 1):                                # step 6: B1 B0, I from the middle
        if i == half and rank % 2 == 1:
            split = True
        b(1, split)
        if i == half and rank % 2 == 0:
            split = True
        b(0, split)
    for _ in range(last - rank):                             # step 7: W I0
        w()
        b(0, split)
    for _ in range(rank + 1):                                # step 8: W
        w()
    return ops


def _dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    num_stages = 2 * num_ranks
    return Schedule(
        name="dualpipev",
        num_ranks=num_ranks,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        placement=tuple((min(s, num_stages - 1 - s),) for s in range(num_stages)),
        actions=tuple(tuple(_dualpipev_rank(num_ranks, num_microbatches, r))
                      for r in range(num_ranks)),
    )


def _dualpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    half_ranks, half_mbs = num_ranks // 2, num_microbatches // 2

    def shift(action: Action, rank: int) -> Action:
        # Stage s runs micro-batches 0..N/2-1 on rank s, the second half on rank P-1-s.
        fields = {"microbatch": action.microbatch + (half_mbs if action.stage != rank else 0)}
        if action.b_stage is not None:
            fields["b_microbatch"] = action.b_microbatch + (
                half_mbs if action.b_stage != rank else 0)
        return Action(action.kind, action.stage, peer=action.peer, b_stage=action.b_stage,
                      **fields)

    actions = tuple(
        tuple(shift(a, r) for a in _dualpipev_rank(half_ranks, half_mbs, min(r, num_ranks - 1 - r)))
        for r in range(num_ranks)
    )
    return Schedule(
        name="dualpipe",
        num_ranks=num_ranks,
        num_stages=num_ranks,
        num_microbatches=num_microbatches,
        placement=tuple((s, num_ranks - 1 - s) for s in range(num_ranks)),
        actions=actions,
    )
