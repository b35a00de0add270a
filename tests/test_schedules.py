"""Pipeline schedules: the action IR, the builders, p2p lowering and the DualPipeV oracle."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from zeroc.passes.program.comm_lowering import lower_communication, p2p_groups, verify_p2p
from zeroc.passes.program.schedule import SCHEDULE_NAMES, build_schedule
from zeroc.runtime.actions import (
    Action,
    ActionKind,
    Schedule,
    check_compute_schedule,
    forward,
    overlapped,
)

MICROBATCHES = (1, 2, 3, 5, 8, 9, 16, 17, 20)


def all_valid_schedules():
    """Every (name, P, N) the builders accept for P = 1..8 and the N above."""
    for name in SCHEDULE_NAMES:
        for ranks in range(1, 9):
            for mbs in MICROBATCHES:
                try:
                    yield build_schedule(name, ranks, mbs)
                except ValueError:
                    continue


def test_action_text_round_trip():
    actions = [
        forward(1, 3),
        Action(ActionKind.B, 0, 1),
        Action(ActionKind.W, 2, 2),
        overlapped(0, 4, 7, 0),
        Action(ActionKind.SEND_F, 1, 3, peer=2),
        Action(ActionKind.RECV_B, 2, 3, peer=3),
        Action(ActionKind.UNSHARD, 1),
    ]
    assert [str(a) for a in actions] == [
        "F3@s1", "B1@s0", "W2@s2", "F4@s0&B0@s7", "SEND_F3@s1->r2", "RECV_B3@s2<-r3",
        "UNSHARD@s1",
    ]
    assert [a.short() for a in actions[:4]] == ["F3", "B1", "W2", "F4&B0"]
    assert [Action.parse(str(a)) for a in actions] == actions
    assert [Action.from_dict(json.loads(json.dumps(a.to_dict()))) for a in actions] == actions
    assert overlapped(0, 4, 7, 0).parts() == (forward(0, 4), Action(ActionKind.B, 7, 0))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": ActionKind.FB, "stage": 0, "microbatch": 1},
        {"kind": ActionKind.SEND_F, "stage": 0, "microbatch": 1},
        {"kind": ActionKind.F, "stage": 0, "microbatch": 1, "peer": 2},
        {"kind": ActionKind.F, "stage": 0},
        {"kind": ActionKind.UNSHARD, "stage": 0, "microbatch": 1},
        {"kind": ActionKind.F, "stage": -1, "microbatch": 0},
        {"kind": "X", "stage": 0, "microbatch": 0},
    ],
)
def test_malformed_actions_are_rejected(kwargs):
    with pytest.raises(ValueError):
        Action(**kwargs)


def test_unknown_schedule_lists_known_names():
    with pytest.raises(ValueError, match="known schedules: gpipe, 1f1b, zb1p, dualpipe, dualpipev"):
        build_schedule("interleaved", 4, 8)


@pytest.mark.parametrize(
    "name, ranks, mbs, message",
    [
        ("dualpipe", 3, 12, "even num_ranks"),
        ("dualpipe", 4, 9, "even num_microbatches >= 2 \\* num_ranks"),
        ("dualpipe", 4, 6, "even num_microbatches >= 2 \\* num_ranks \\(= 8\\)"),
        ("dualpipev", 4, 7, "num_microbatches >= 2 \\* num_ranks"),
        ("1f1b", 0, 4, "num_ranks must be an integer >= 1"),
        ("gpipe", 2, 0, "num_microbatches must be an integer >= 1"),
        ("zb1p", True, 4, "num_ranks"),
    ],
)
def test_size_constraints(name, ranks, mbs, message):
    with pytest.raises(ValueError, match=message):
        build_schedule(name, ranks, mbs)


def test_linear_schedules_allow_fewer_microbatches_than_ranks():
    for name in ("gpipe", "1f1b", "zb1p"):
        schedule = build_schedule(name, 8, 3)
        assert schedule.placement == tuple((r,) for r in range(8))


def test_every_schedule_computes_every_pair_once():
    built = Counter(s.name for s in all_valid_schedules())
    assert set(built) == set(SCHEDULE_NAMES)
    for schedule in all_valid_schedules():
        check_compute_schedule(schedule)
        ops = Counter(p.kind for rank in schedule.actions for a in rank for p in a.parts())
        pairs = schedule.num_stages * schedule.num_microbatches
        assert ops[ActionKind.F] == pairs
        assert ops[ActionKind.B] + ops[ActionKind.I] == pairs
        assert ops[ActionKind.W] == ops[ActionKind.I]


def test_check_compute_schedule_catches_errors():
    good = build_schedule("1f1b", 2, 2)
    rank0 = list(good.actions[0])
    missing = good.replace_actions((tuple(rank0[:-1]), good.actions[1]))
    with pytest.raises(ValueError, match="needs exactly one of B or I"):
        check_compute_schedule(missing)
    wrong_rank = good.replace_actions((good.actions[0] + (forward(1, 0),), good.actions[1]))
    with pytest.raises(ValueError, match="placed on 1"):
        check_compute_schedule(wrong_rank)
    reversed_rank0 = good.replace_actions((tuple(reversed(rank0)), good.actions[1]))
    with pytest.raises(ValueError, match="backward runs before"):
        check_compute_schedule(reversed_rank0)


def test_placements():
    v = build_schedule("dualpipev", 4, 8)
    assert v.num_stages == 8
    assert v.placement == ((0,), (1,), (2,), (3,), (3,), (2,), (1,), (0,))
    d = build_schedule("dualpipe", 4, 8)
    assert d.placement == ((0, 3), (1, 2), (2, 1), (3, 0))
    assert [d.rank_of(0, m) for m in range(8)] == [0, 0, 0, 0, 3, 3, 3, 3]


@pytest.mark.parametrize("ranks", [2, 4, 6, 8])
@pytest.mark.parametrize("extra", [0, 2, 6])
def test_dualpipe_is_dualpipev_cut_in_half(ranks, extra):
    mbs = 2 * ranks + extra
    full = build_schedule("dualpipe", ranks, mbs)
    half = build_schedule("dualpipev", ranks // 2, mbs // 2)
    for rank in range(ranks):
        mirror = min(rank, ranks - 1 - rank)
        ours = full.actions[rank]
        theirs = half.actions[mirror]
        assert [(a.kind, a.stage, a.b_stage) for a in ours] == [
            (a.kind, a.stage, a.b_stage) for a in theirs]
        for a, b in zip(ours, theirs, strict=True):
            # Micro-batches of the stream entering at rank P-1 are numbered N/2..N-1.
            assert a.microbatch % (mbs // 2) == b.microbatch
            assert (a.microbatch >= mbs // 2) == (a.stage != rank)


def torch_dualpipev_order(ranks: int, mbs: int) -> list[list[Action]]:
    """torch.distributed.pipelining's DualPipeV order, without a process group."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules, "ScheduleDualPipeV"):
        pytest.skip("this torch has no ScheduleDualPipeV")
    oracle = object.__new__(schedules.ScheduleDualPipeV)
    oracle.pp_group_size = ranks
    oracle._n_microbatches = mbs

    def convert(action) -> Action:
        if action.sub_actions is not None:
            fwd, bwd = (convert(sub) for sub in action.sub_actions)
            return overlapped(fwd.stage, fwd.microbatch, bwd.stage, bwd.microbatch)
        kind = ActionKind(action.computation_type.value)
        return Action(kind, action.stage_index, action.microbatch_index)

    return [[convert(a) for a in oracle._calculate_single_rank_operations(rank)]
            for rank in range(ranks)]


@pytest.mark.parametrize("ranks", range(1, 9))
def test_dualpipev_matches_torch_pipelining(ranks):
    for mbs in (2 * ranks, 2 * ranks + 1, 2 * ranks + 4, 5 * ranks + 3):
        ours = build_schedule("dualpipev", ranks, mbs)
        assert [list(r) for r in ours.actions] == torch_dualpipev_order(ranks, mbs)


@pytest.mark.parametrize("ranks", range(1, 9))
def test_zb1p_matches_torch_zero_bubble_with_one_stage_per_rank(ranks):
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for mbs in range(ranks, 3 * ranks + 1):
        rounds = max(1, mbs // ranks)
        if mbs % rounds:
            continue  # torch's zero-bubble schedule needs N to be a multiple of its rounds
        oracle = object.__new__(schedules.ScheduleInterleavedZeroBubble)
        oracle.n_local_stages, oracle.pp_group_size, oracle._n_microbatches = 1, ranks, mbs
        oracle.number_of_rounds, oracle.microbatches_per_round = rounds, mbs // rounds
        ours = build_schedule("zb1p", ranks, mbs)
        for rank in range(ranks):
            theirs = [Action(ActionKind(a.computation_type.value), a.stage_index,
                             a.microbatch_index)
                      for a in oracle._calculate_single_rank_operations(rank) if a is not None]
            assert list(ours.actions[rank]) == theirs


def _split_fb(actions: tuple[Action, ...]) -> tuple[Action, ...]:
    return tuple(p for a in actions for p in (a.parts() if a.kind is ActionKind.FB else (a,)))


@pytest.mark.parametrize("split", [False, True], ids=["fb", "fb-split"])
def test_lowering_is_deadlock_free_and_matched(split: bool):
    for schedule in all_valid_schedules():
        lowered = lower_communication(schedule, split_overlapped=split)
        verify_p2p(lowered)
        expected = [_split_fb(a) if split else a for a in schedule.actions]
        assert [lowered.compute_actions(r) for r in range(schedule.num_ranks)] == expected
        kinds = Counter(a.kind for rank in lowered.actions for a in rank)
        assert kinds[ActionKind.SEND_F] == kinds[ActionKind.RECV_F]
        assert kinds[ActionKind.SEND_B] == kinds[ActionKind.RECV_B]
        # Every stage boundary crossed by a micro-batch moves one activation and one gradient;
        # DualPipeV's turn at the V (stages P-1 and P on rank P-1) moves nothing.
        crossings = (schedule.num_ranks - 1) * (2 if schedule.name == "dualpipev" else 1)
        assert kinds[ActionKind.SEND_F] == crossings * schedule.num_microbatches
        assert kinds[ActionKind.SEND_B] == crossings * schedule.num_microbatches
        for rank, actions in enumerate(lowered.actions):
            assert all(a.peer != rank for a in actions if a.is_p2p)


def test_dualpipev_turn_has_no_communication():
    lowered = lower_communication(build_schedule("dualpipev", 4, 8))
    p2p = [a for rank in lowered.actions for a in rank if a.is_p2p]
    assert not [a for a in p2p if a.kind is ActionKind.SEND_F and a.stage == 3]
    assert not [a for a in p2p if a.kind is ActionKind.SEND_B and a.stage == 4]
    assert lowered.actions[0][:2] == (forward(0, 0), Action(ActionKind.SEND_F, 0, 0, peer=1))
    assert lowered.actions[1][:2] == (Action(ActionKind.RECV_F, 1, 0, peer=0), forward(1, 0))


def test_split_overlapped_actions_send_the_forward_chunk_before_the_backward_computes():
    """Without collectives in the stage graphs, FB is lowered as F, its sends, B, its sends:
    the forward chunk's transfer is in flight while the backward chunk computes, and the
    backward chunk's receive is waited only when B starts."""
    for ranks in (2, 4):
        schedule = build_schedule("dualpipev", ranks, 2 * ranks)
        lowered = lower_communication(schedule, split_overlapped=True)
        fbs = [(r, a) for r in range(ranks) for a in schedule.actions[r]
               if a.kind is ActionKind.FB]
        assert fbs and not any(a.kind is ActionKind.FB for r in lowered.actions for a in r)
        for rank, fb in fbs:
            f, b = fb.parts()
            actions = lowered.actions[rank]
            at_f, at_b = actions.index(f), actions.index(b)
            between = actions[at_f + 1:at_b]
            sends_f = [a for a in between if a.kind is ActionKind.SEND_F]
            crosses = schedule.rank_of(f.stage + 1, f.microbatch) != rank if (
                f.stage + 1 < schedule.num_stages) else False
            assert all(a.is_p2p for a in between), (rank, between)
            assert len(sends_f) == (1 if crosses else 0), (rank, fb, between)


def test_p2p_groups_batch_consecutive_transfers():
    lowered = lower_communication(build_schedule("dualpipev", 2, 4))
    groups = p2p_groups(lowered.actions[0])
    assert sum(len(g) for g in groups) == len(lowered.actions[0])
    assert any(len(g) == 2 and all(a.is_p2p for a in g) for g in groups)
    assert all(len(g) == 1 for g in groups if not g[0].is_p2p)


def test_verify_p2p_finds_deadlock_and_mismatch():
    lowered = lower_communication(build_schedule("1f1b", 2, 2))
    rank0, rank1 = (list(r) for r in lowered.actions)
    recv = next(a for a in rank0 if a.kind is ActionKind.RECV_B)
    early_recv = [recv] + [a for a in rank0 if a != recv]
    with pytest.raises(ValueError, match="deadlocks"):
        verify_p2p(lowered.replace_actions((tuple(early_recv), tuple(rank1))))
    recvs = [i for i, a in enumerate(rank1) if a.kind is ActionKind.RECV_F]
    swapped = list(rank1)
    swapped[recvs[0]], swapped[recvs[1]] = swapped[recvs[1]], swapped[recvs[0]]
    with pytest.raises(ValueError, match="do not match receives"):
        verify_p2p(lowered.replace_actions((tuple(rank0), tuple(swapped))))
    no_recv = [a for a in rank1 if a.kind is not ActionKind.RECV_F]
    with pytest.raises(ValueError, match="do not match receives"):
        verify_p2p(lowered.replace_actions((tuple(rank0), tuple(no_recv))))
    with pytest.raises(ValueError, match="already has p2p"):
        lower_communication(lowered)


def test_schedule_json_round_trip():
    for name, ranks, mbs in (("dualpipe", 4, 8), ("zb1p", 3, 5), ("dualpipev", 2, 5)):
        lowered = lower_communication(build_schedule(name, ranks, mbs))
        again = Schedule.from_dict(json.loads(json.dumps(lowered.to_dict())))
        assert again == lowered
        assert str(again).splitlines()[0] == (
            f"schedule {name}: ranks={ranks} stages={lowered.num_stages} microbatches={mbs}")
