"""Plans at scale: identical ranks grouped in per-rank tables, the schedule grid cut to some
ranks and wrapped into bands that fit a width, and a Plan's grid drawn again for chosen ranks."""

from __future__ import annotations

import pytest
from torch.testing import FileCheck

from zeroc.passes.program.schedule import build_schedule
from zeroc.runtime.cost.simulate import ActionCosts, simulate
from zeroc.runtime.plan.plan import Plan, PlanMeta
from zeroc.runtime.plan.plan_text import (
    GROUPED_NOTE,
    format_ranks,
    memory_groups,
    render_pipeline,
    render_plan,
)
from zeroc.runtime.plan.records import MemoryEstimate, PipelineInfo
from zeroc.runtime.plan.schedule_grid import render_grid

WIDE = 100_000  # one band: the grid as drawn before wrapping


def _meta() -> PlanMeta:
    return PlanMeta(format=1, zeroc_version="0", torch_version="0", triton_version="-",
                    device="cpu", world_size=64, mesh=(("pp", 8), ("dp", 8)), zero=3,
                    schedule="zb1p", options=(), graph_hash="abc")


def _plan(memory: tuple[MemoryEstimate, ...], pipeline: PipelineInfo | None = None) -> Plan:
    return Plan(meta=_meta(), graphs=(), stages=(), params=(), kernels=(), collectives=(),
                memory=memory, passes=(), pipeline=pipeline)


def _memory(pp: int, dp: int) -> tuple[MemoryEstimate, ...]:
    """One estimate per rank; the ranks of one pipeline position hold the same bytes."""
    return tuple(MemoryEstimate(rank=p * dp + d, params=1000 * (p + 1), grads=1000 * (p + 1),
                                optimizer=2000 * (p + 1), activations=300, peak=4300 * (p + 1),
                                moved=50)
                 for p in range(pp) for d in range(dp))


def _info(name: str, ranks: int, microbatches: int, unit: float = 0.0,
          costs: tuple[tuple[float, float, float], ...] | None = None) -> PipelineInfo:
    """What ``pipeline_info`` records for a schedule simulated with per-stage costs."""
    schedule = build_schedule(name, ranks, microbatches)
    costs = costs or tuple((1.0, 2.0, 1.0) for _ in range(schedule.num_stages))
    timeline = simulate(schedule, ActionCosts(stages=costs))
    legend = "time unit: one forward\n  " + ", ".join(f"s{s} F=1" for s in range(len(costs)))
    return PipelineInfo(
        schedule=name, num_ranks=ranks, num_stages=schedule.num_stages,
        num_microbatches=microbatches, placement=schedule.placement,
        actions=tuple(tuple(str(a) for a in schedule.compute_actions(r)) for r in range(ranks)),
        grid=render_grid(schedule, timeline, unit or None) + "\n" + legend,
        bubble_ratios=tuple(timeline.bubble_ratio(r) for r in range(ranks)),
        measured_bubble_ratios=(), peak_activations=timeline.peak_activations,
        peak_activation_bytes=tuple(1024 * p for p in timeline.peak_activations),
        event_labels=(), event_times=(), stage_costs=costs, grid_time_unit=unit,
        grid_legend=legend)


def _grid_lines(text: str) -> list[str]:
    """The grid part of ``render_grid``'s text (the summary table follows the last blank)."""
    return text.rsplit("\n\n", 1)[0].splitlines()


def _rows(text: str) -> list[tuple[str, str]]:
    """(rank label, cells) of every grid row, band after band."""
    return [tuple(line.split(" | ", 1)) if " | " in line else (line.rstrip(" |"), "")
            for line in _grid_lines(text) if line.startswith("rank ")]


def test_format_ranks_writes_runs() -> None:
    assert format_ranks(range(8)) == "0-7"
    assert format_ranks([2, 0]) == "0,2"
    assert format_ranks([11, 0, 1, 2, 3, 8, 10, 3]) == "0-3,8,10-11"
    assert format_ranks([5]) == "5"
    assert format_ranks([]) == ""


def test_memory_of_64_ranks_in_8_positions_is_8_rows() -> None:
    groups = memory_groups(_memory(8, 8))
    assert [format_ranks(ranks) for ranks, _ in groups] == [
        f"{8 * p}-{8 * p + 7}" for p in range(8)]
    assert [m.params for _, m in groups] == [1000 * (p + 1) for p in range(8)]
    text = render_plan(_plan(_memory(8, 8)))
    section = text.split("estimated memory per rank:", 1)[1].split("passes:", 1)[0]
    rows = [line.split()[0] for line in section.splitlines()[3:] if line[:1].isdigit()]
    assert rows == [f"{8 * p}-{8 * p + 7}" for p in range(8)]
    FileCheck().check("estimated memory per rank").check("0-7").check("56-63") \
        .check("at rest = params").check("rows are grouped when identical").run(text)


def test_only_consecutive_identical_ranks_are_grouped() -> None:
    memory = list(_memory(1, 8))
    memory[5] = MemoryEstimate(rank=5, params=1, grads=1, optimizer=2, activations=300,
                               peak=304, moved=50)
    assert [format_ranks(r) for r, _ in memory_groups(memory)] == ["0-4", "5", "6-7"]
    a, b = _memory(2, 1)
    again = MemoryEstimate(rank=2, params=a.params, grads=a.grads, optimizer=a.optimizer,
                           activations=a.activations, peak=a.peak, moved=a.moved)
    assert [r for r, _ in memory_groups((a, b, again))] == [(0,), (1,), (2,)]
    # Rows in mesh order: ranks 0 and 2 share position 0 when pp is the fastest dimension.
    swapped = (a, MemoryEstimate(**{**again.__dict__, "rank": 2}),
               MemoryEstimate(**{**b.__dict__, "rank": 1}))
    assert [format_ranks(r) for r, _ in memory_groups(swapped)] == ["0,2", "1"]


def test_single_rank_memory_table_is_unchanged() -> None:
    text = render_plan(_plan(_memory(1, 1)))
    assert "rows are grouped" not in text
    FileCheck().check("estimated memory per rank:").check_regex(r"\n\s+0\s+1000 B").run(text)


def test_pipeline_table_groups_only_identical_ranks() -> None:
    # DualPipe: ranks 3 and 4 hold stages 3 and 4 and run alike; ranks 0 and 7 (stages 0,7)
    # are alike too but not next to each other.
    text = render_pipeline(_info("dualpipe", 8, 16))
    table = text.rsplit("\n\n", 1)[1]
    labels = [line.split()[0] for line in table.splitlines()[2:] if line[:1].isdigit()]
    assert labels == ["0", "1", "2", "3-4", "5", "6", "7"]
    assert GROUPED_NOTE in table
    linear = render_pipeline(_info("zb1p", 4, 8)).rsplit("\n\n", 1)[1]
    assert "rows are grouped" not in linear
    assert [line.split()[0] for line in linear.splitlines()[2:] if line.lstrip()[:1].isdigit()] == [
        "0", "1", "2", "3"]
    assert "rank = position in the pipeline" in linear


@pytest.mark.parametrize("width", [60, 80, 100, 137])
def test_dualpipev_8_ranks_fits_the_width(width: int) -> None:
    schedule = build_schedule("dualpipev", 8, 16)
    wide = render_grid(schedule, width=WIDE)
    assert max(len(line) for line in wide.splitlines()) > 400
    text = render_grid(schedule, width=width)
    assert all(len(line) <= width for line in _grid_lines(text))
    bands = [line for line in _grid_lines(text) if line.startswith("columns ")]
    assert len(bands) > 1 and bands[0].startswith("columns 0-")
    rows = _rows(text)
    assert len(rows) == 8 * len(bands)
    assert [label for label, _ in rows[:8]] == [f"rank {r:>2}" for r in range(8)]
    # The summary table still lists every rank and is the same as unwrapped.
    assert text.rsplit("\n\n", 1)[1] == wide.rsplit("\n\n", 1)[1]


@pytest.mark.parametrize("name, ranks, microbatches", [("dualpipev", 8, 16), ("zb1p", 64, 64),
                                                       ("1f1b", 4, 6)])
def test_bands_keep_every_cell_where_it_was(name: str, ranks: int, microbatches: int) -> None:
    schedule = build_schedule(name, ranks, microbatches)
    drawn = sorted({0, 1, ranks // 2, ranks - 2, ranks - 1}) if ranks > 8 else range(ranks)
    wide = dict(_rows(render_grid(schedule, ranks=drawn, width=WIDE)))
    column = wide["rank  0"].index("|") + 1  # rank 0 starts with one F of one column
    text = render_grid(schedule, ranks=drawn, width=80)
    bands = [tuple(int(c) for c in line.split()[1].rstrip(",").split("-"))
             for line in _grid_lines(text) if line.startswith("columns ")]
    rows = _rows(text)
    for band, (start, last) in enumerate(bands or [(0, WIDE)]):
        for label, cells in rows[band * len(drawn):(band + 1) * len(drawn)]:
            expected = wide[label][column * start:column * (last + 1)].rstrip()
            if "<" not in cells and ">" not in cells:
                assert cells == expected
            else:  # a cut cell: the same boundaries, its label where it fits
                assert [i for i, c in enumerate(cells) if c == "|"] == [
                    i for i, c in enumerate(expected) if c == "|"]
    labels = {tok.strip("<") for _, cells in rows for tok in cells.replace("|", " ")
              .replace(">", " ").split()}
    assert labels - {""} == {tok for cells in wide.values()
                             for tok in cells.replace("|", " ").split()}


def test_64_ranks_draw_a_subset() -> None:
    schedule = build_schedule("zb1p", 64, 64)
    assert max(len(line) for line in render_grid(schedule, width=WIDE).splitlines()) > 1000
    text = render_grid(schedule, width=100)
    assert {label for label, _ in _rows(text)} == {
        "rank  0", "rank  1", "rank 32", "rank 62", "rank 63"}
    FileCheck().check("schedule zb1p: 64 ranks").check("ranks drawn: 0-1,32,62-63 of 64") \
        .check("plan.schedule_grid").check("columns 0-").check_regex(r"\n\s+32\s+32\s") \
        .check("makespan").run(text)
    assert all(len(line) <= 100 for line in _grid_lines(text))
    table = text.rsplit("\n\n", 1)[1].splitlines()
    assert [line.split()[0] for line in table[2:-1]] == ["0", "1", "32", "62", "63"]
    chosen = render_grid(schedule, ranks=[5, 3, 3], width=120)
    assert {label for label, _ in _rows(chosen)} == {"rank  3", "rank  5"}
    assert "ranks drawn: 3,5 of 64" in chosen
    assert "ranks drawn" not in render_grid(schedule, ranks=range(64), width=WIDE)
    assert "ranks drawn" not in render_grid(build_schedule("dualpipev", 8, 16))


def test_grid_arguments_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    schedule = build_schedule("zb1p", 64, 64)
    for ranks, message in (([], "at least one rank"), ([0, 64], r"ranks \[64\] are not")):
        with pytest.raises(ValueError, match=message):
            render_grid(schedule, ranks=ranks)
    with pytest.raises(ValueError, match="width must be >= 40"):
        render_grid(schedule, width=30)
    monkeypatch.setenv("COLUMNS", "72")
    assert max(len(line) for line in _grid_lines(render_grid(schedule))) <= 72
    monkeypatch.setenv("COLUMNS", "20")  # the default is never below 60
    assert 50 < max(len(line) for line in _grid_lines(render_grid(schedule))) <= 60


def test_one_band_when_the_grid_fits() -> None:
    schedule = build_schedule("1f1b", 4, 6)
    assert render_grid(schedule, width=100) == render_grid(schedule, width=WIDE)
    assert "columns " not in render_grid(schedule, width=100)


def test_plan_draws_its_grid_again_for_chosen_ranks() -> None:
    costs = tuple((1.0 + s % 3, 2.0 + s % 3, 1.0) for s in range(16))
    info = _info("zb1p", 16, 32, unit=0.5, costs=costs)
    plan = _plan(_memory(16, 1), info)
    schedule = build_schedule("zb1p", 16, 32)
    timeline = simulate(schedule, ActionCosts(stages=costs))
    text = plan.schedule_grid(ranks=[0, 15], width=90)
    grid = render_grid(schedule, timeline, 0.5, ranks=[0, 15], width=90)
    assert text.startswith(grid + "\n")
    legend = text[len(grid) + 1:].splitlines()  # the legend, wrapped at the width
    assert legend[0] == "time unit: one forward" and len(legend) > 2
    assert all(len(line) <= 90 and line.startswith("  s") for line in legend[1:])
    assert " ".join(legend).split() == info.grid_legend.split()
    assert text.startswith(info.grid.splitlines()[0])  # same simulation, same column unit
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.pipeline.stage_costs == costs
    assert again.schedule_grid(ranks=[0, 15], width=90) == text
    default = plan.schedule_grid(width=70)
    assert "ranks drawn: 0-1,8,14-15 of 16" in default
    assert all(len(line) <= 70 for line in _grid_lines(default))


def test_plan_grid_without_stored_costs_or_pipeline() -> None:
    info = _info("1f1b", 4, 8)
    bare = PipelineInfo(**{**info.__dict__, "stage_costs": (), "grid_time_unit": 0.0,
                           "grid_legend": ""})
    text = _plan(_memory(4, 1), bare).schedule_grid(ranks=[1], width=80)
    FileCheck().check("schedule 1f1b: 4 ranks").check("rank  1 |").check("keeps no stage costs") \
        .run(text)
    with pytest.raises(ValueError, match="has no pipeline"):
        _plan(_memory(1, 1)).schedule_grid()
