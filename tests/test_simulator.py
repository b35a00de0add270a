"""Timing simulation of pipeline schedules and the text grid.

The anchor numbers come from the DualPipe README's table (same number of stages):
bubble 1F1B (PP-1)(F+B), ZB1P (PP-1)(F+B-2W), DualPipe/V (PP/2-1)(F&B+B-3W); activations per
device PP, PP, PP+1, PP+1.
"""

from __future__ import annotations

import pytest
from torch.testing import FileCheck

from zeroc.passes.program.comm_lowering import lower_communication
from zeroc.passes.program.schedule import SCHEDULE_NAMES, build_schedule
from zeroc.runtime.actions import Action, ActionKind, Schedule, data_inputs, forward, overlapped
from zeroc.runtime.cost.simulate import ActionCosts, peak_activations, simulate
from zeroc.runtime.plan.schedule_grid import cell_label, render_grid

README_COSTS = ActionCosts(forward=1, backward=2, weight=1, overlapped=3)


def test_dualpipe_readme_numbers():
    pp, n = 8, 20
    one_f_one_b = simulate(build_schedule("1f1b", pp, n), README_COSTS)
    assert one_f_one_b.bubble == (pp - 1) * (1 + 2) == 21
    assert max(one_f_one_b.peak_activations) == pp
    zero_bubble = simulate(build_schedule("zb1p", pp, n), README_COSTS)
    assert zero_bubble.bubble == (pp - 1) * (1 + 2 - 2 * 1) == 7
    assert max(zero_bubble.peak_activations) == pp
    dualpipe = simulate(build_schedule("dualpipe", pp, n), README_COSTS)
    assert dualpipe.bubble == (pp // 2 - 1) * (3 + 2 - 3 * 1) == 6
    assert max(dualpipe.peak_activations) == pp + 1
    # DualPipeV on PP/2 ranks has the same 8 stages.
    dualpipev = simulate(build_schedule("dualpipev", pp // 2, n), README_COSTS)
    assert dualpipev.bubble == 6
    assert max(dualpipev.peak_activations) == pp + 1
    assert dualpipe.makespan == 66 and one_f_one_b.makespan == 81


@pytest.mark.parametrize("forward_cost, backward_cost, weight_cost", [(1, 2, 1), (2, 3, 1),
                                                                      (2, 4, 2), (1, 3, 1)])
@pytest.mark.parametrize("pp", [2, 4, 6, 8])
def test_bubble_formulas(forward_cost, backward_cost, weight_cost, pp):
    costs = ActionCosts(forward_cost, backward_cost, weight_cost)
    fb = forward_cost + backward_cost
    for n in (2 * pp, 3 * pp + 2):
        assert simulate(build_schedule("1f1b", pp, n), costs).bubble == (pp - 1) * fb
        assert simulate(build_schedule("gpipe", pp, n), costs).bubble == (pp - 1) * fb
        assert simulate(build_schedule("zb1p", pp, n), costs).bubble == (
            (pp - 1) * (fb - 2 * weight_cost))
        formula = (pp // 2 - 1) * (fb + backward_cost - 3 * weight_cost)
        dualpipe = simulate(build_schedule("dualpipe", pp, n), costs).bubble
        if backward_cost - weight_cost == forward_cost:
            assert dualpipe == formula
        else:
            # I > F: the README's formula bounds the simulated bubble from above.
            assert formula - 1 <= dualpipe <= formula


def test_peak_activations_per_rank():
    assert simulate(build_schedule("gpipe", 4, 6)).peak_activations == (6, 6, 6, 6)
    assert simulate(build_schedule("1f1b", 4, 6)).peak_activations == (4, 3, 2, 1)
    assert simulate(build_schedule("zb1p", 4, 6)).peak_activations == (4, 4, 4, 4)
    assert peak_activations((forward(0, 0), forward(0, 1), overlapped(0, 2, 0, 0))) == 3
    assert peak_activations((forward(0, 0), Action(ActionKind.I, 0, 0), forward(0, 1))) == 2


def test_timeline_respects_dependencies():
    for name in SCHEDULE_NAMES:
        ranks = 4 if name != "dualpipev" else 2
        schedule = build_schedule(name, ranks, 8)
        timeline = simulate(schedule, ActionCosts(1.0, 2.5, 1.0, overlapped=3.0))
        done: dict[tuple[str, int, int], float] = {}
        for rank_actions in timeline.ranks:
            for timed in rank_actions:
                for part in timed.action.parts():
                    tag = {"F": "F", "B": "G", "I": "G", "W": "W"}[part.kind.value]
                    done[(tag, part.stage, part.microbatch)] = timed.end
        for rank_actions in timeline.ranks:
            for before, after in zip(rank_actions, rank_actions[1:], strict=False):
                assert before.end <= after.start
            for timed in rank_actions:
                for part in timed.action.parts():
                    for key in data_inputs(part, schedule.num_stages - 1):
                        assert done[key] <= timed.start
        assert all(b >= 0 for b in timeline.rank_bubbles)
        assert sum(timeline.busy) == pytest.approx(
            sum(t.end - t.start for rank in timeline.ranks for t in rank))


def test_p2p_latency_and_lowered_schedules():
    schedule = build_schedule("gpipe", 2, 1)
    latency = 0.25
    timeline = simulate(schedule, ActionCosts(p2p_latency=latency))
    # F on rank 0, F and B on rank 1 after one transfer, B on rank 0 after another.
    assert timeline.makespan == 1 + latency + 1 + 2 + latency + 2
    lowered = lower_communication(build_schedule("dualpipe", 4, 8))
    assert simulate(lowered, README_COSTS) == simulate(build_schedule("dualpipe", 4, 8),
                                                       README_COSTS)


def test_deadlock_is_reported():
    crossed = Schedule(
        name="crossed", num_ranks=2, num_stages=2, num_microbatches=2,
        placement=((0,), (1,)),
        actions=(
            (forward(0, 0), Action(ActionKind.B, 0, 0), forward(0, 1), Action(ActionKind.B, 0, 1)),
            (forward(1, 1), Action(ActionKind.B, 1, 1), forward(1, 0), Action(ActionKind.B, 1, 0)),
        ),
    )
    with pytest.raises(ValueError, match="deadlocks; ranks wait at: B0@s0, F1@s1"):
        simulate(crossed)


def test_costs_validation():
    assert ActionCosts(backward=3, weight=1).of(Action(ActionKind.I, 0, 0)) == 2
    assert ActionCosts(forward=1, backward=2).of(overlapped(0, 1, 1, 0)) == 3
    with pytest.raises(ValueError, match="ActionCosts.forward must be >= 0"):
        ActionCosts(forward=-1)
    with pytest.raises(ValueError, match="exceeds backward"):
        ActionCosts(backward=1, weight=2)
    with pytest.raises(ValueError, match="not a compute action"):
        ActionCosts().of(Action(ActionKind.UNSHARD, 0))


def test_grid_1f1b_golden():
    text = render_grid(build_schedule("1f1b", 4, 6), width=100)  # one band on any terminal
    grid = [row.split(" | ", 1) for row in text.splitlines()[1:5]]
    assert [label for label, _ in grid] == ["rank  0", "rank  1", "rank  2", "rank  3"]
    assert [cells for _, cells in grid] == [
        "F0|F1|F2|F3|                  B0   |F4|B1   |F5|B2   |   B3   |   B4   |   B5   |",
        "   F0|F1|F2|            B0   |F3|B1   |F4|B2   |F5|B3   |   B4   |   B5   |",
        "      F0|F1|      B0   |F2|B1   |F3|B2   |F4|B3   |F5|B4   |   B5   |",
        "         F0|B0   |F1|B1   |F2|B2   |F3|B3   |F4|B4   |F5|B5   |",
    ]
    FileCheck().check("rank").check("stages").check("bubble ratio").check("peak activations") \
        .check_regex(r"0\s+0\s+18\s+9\s+33.3%\s+4").check("makespan 27, largest bubble 9") \
        .run(text)


def test_grid_dualpipe_marks_overlap_and_second_stage():
    schedule = build_schedule("dualpipe", 8, 20)
    text = render_grid(schedule, simulate(schedule, README_COSTS), width=1000)  # one band
    rows = text.splitlines()
    assert rows[1].startswith("rank  0 | F0 |F1 |F2 |F3 |F4 |F5 |F6 |f10|i10|w10|")
    assert "F7&b13     |            f14&B0     |" in rows[1]
    assert rows[8].startswith("rank  7 | F10|F11|")
    FileCheck().check("one column = 1").check_regex(r"\n\s+0\s+0,7\s+60\s+6\s+9.1%\s+9") \
        .check_regex(r"\n\s+4\s+3,4\s+60\s+6\s+9.1%\s+9") \
        .check("makespan 66, largest bubble 6").run(text)
    assert cell_label(overlapped(7, 3, 0, 9), second_stage=7) == "f3&B9"


def test_grid_time_unit_and_errors():
    schedule = build_schedule("zb1p", 2, 2)
    halves = render_grid(schedule, time_unit=0.5, width=100)
    assert "one column = 0.5" in halves
    assert halves.splitlines()[1].startswith("rank  0 | F0 |F1 |")
    with pytest.raises(ValueError, match="time_unit must be > 0"):
        render_grid(schedule, time_unit=0)
    with pytest.raises(ValueError, match="timeline has 4 ranks"):
        render_grid(schedule, simulate(build_schedule("1f1b", 4, 4)))




def test_per_stage_costs_drive_the_simulation() -> None:
    """With a last stage three times the first, GPipe's step is bound by the slow stage."""
    schedule = build_schedule("gpipe", 2, 4)
    even = simulate(schedule, ActionCosts(stages=((1, 2, 1), (1, 2, 1))))
    uneven = simulate(schedule, ActionCosts(stages=((1, 2, 1), (3, 6, 3))))
    assert even.makespan == simulate(schedule, ActionCosts()).makespan
    # Stage 1's forwards and backwards run back to back: 4 * 3 + 4 * 6, plus stage 0's first
    # forward before it and last backward after it.
    assert uneven.makespan == 4 * 3 + 4 * 6 + 1 + 2
    assert uneven.bubble_ratio(0) > even.bubble_ratio(0)
    assert ActionCosts(stages=((1, 4, 1), (2, 6, 2))).of(overlapped(0, 1, 1, 0)) == 1 + 6
    with pytest.raises(ValueError, match=r"ActionCosts.stages must hold"):
        ActionCosts(stages=((1, 1, 2),))


def test_plan_grid_uses_measured_stage_costs() -> None:
    from zeroc.pipeline.pipeline_plan import _measured_costs

    labels = (("F0@s0", "F1@s0", "SEND_F0@s0->r1", "B0@s0"), ("F0@s1", "I0@s1", "W0@s1"))
    times = (((0.0, 0.002), (0.002, 0.006), (0.006, 0.007), (0.01, 0.02)),
             ((0.0, 0.001), (0.001, 0.003), (0.003, 0.004)))
    costs = _measured_costs(labels, times, 2)
    assert [c for stage in costs for c in stage] == pytest.approx([3.0, 10.0, 0.0, 1.0, 3.0, 1.0])
    assert _measured_costs(labels[:1], times[:1], 2) is None  # stage 1 never ran here
