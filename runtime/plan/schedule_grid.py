"""Text rendering of a pipeline schedule: a rank-by-time grid and a per-rank summary.

The grid draws one row per rank and one column per time slot, like the figure in the DualPipe
paper: each compute action is a cell ``label|`` spanning its simulated duration, and blank
space is bubble. Labels: ``F3`` forward of micro-batch 3, ``B1`` full backward, ``I2``/``W2``
the input- and weight-gradient halves, ``F4&B0`` an overlapped forward and backward. On a
rank that holds two stages (DualPipe, DualPipeV) the rank's higher-numbered stage is written
in lower case (``f3``, ``b1``, ``F4&b0``), so the two streams are told apart without color.

At scale the grid is cut down two ways. Only some ranks are drawn (``ranks``; by default all
of up to 8 ranks, else the first two, the middle one and the last two, with a line saying
so). The time axis is wrapped into bands of at most ``width`` characters per line, each band
headed by its first column and time; a band ends, within its second half, where the fewest
drawn cells are cut, and a cut cell ends in ``>`` and goes on after ``<`` in the next band.
Within a band every column is the same time slot as in the unwrapped grid.

``pipeline_grid(info)`` draws the grid of a Plan's ``PipelineInfo`` again, for other ranks
or another width, from the compute actions and stage costs the info keeps.
"""

from __future__ import annotations

import operator
import shutil
import textwrap
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tabulate import tabulate

from zeroc.runtime.actions import Action, ActionKind, Schedule
from zeroc.runtime.cost.simulate import ActionCosts, Timeline, simulate
from zeroc.runtime.plan.plan_text import format_ranks

if TYPE_CHECKING:
    from zeroc.runtime.plan.records import PipelineInfo

# Up to this many ranks every rank is drawn by default.
MAX_DRAWN_RANKS = 8
# The default width is the terminal's, but never below this.
DEFAULT_MIN_WIDTH = 60
# An explicit width below this is refused (a rank label and a few cells must fit).
MIN_WIDTH = 40

Cell = tuple[int, int, str]  # (first slot, end slot, label)


def stages_of_rank(schedule: Schedule, rank: int) -> tuple[int, ...]:
    """The stages placed on ``rank``, in increasing order."""
    return tuple(s for s, ranks in enumerate(schedule.placement) if rank in ranks)


def cell_label(action: Action, second_stage: int | None = None) -> str:
    """Grid label of a compute action; ``second_stage`` is written in lower case."""

    def part_label(kind: ActionKind, stage: int, mb: int) -> str:
        letter = kind.value if stage != second_stage else kind.value.lower()
        return f"{letter}{mb}"

    if action.kind is ActionKind.FB:
        return (part_label(ActionKind.F, action.stage, action.microbatch) + "&"
                + part_label(ActionKind.B, action.b_stage, action.b_microbatch))
    if not action.is_compute:
        raise ValueError(f"only compute actions have grid cells, got {action}")
    return part_label(action.kind, action.stage, action.microbatch)


def _slots(timeline: Timeline, time_unit: float) -> list[list[tuple[int, int, Action]]]:
    """Per rank, (first slot, end slot, action) with slots rounded but never overlapping."""
    rows = []
    for rank_actions in timeline.ranks:
        row, free = [], 0
        for timed in rank_actions:
            first = max(free, round(timed.start / time_unit))
            end = max(first + 1, round(timed.end / time_unit))
            row.append((first, end, timed.action))
            free = end
        rows.append(row)
    return rows


def default_ranks(num_ranks: int) -> tuple[int, ...]:
    """The ranks drawn when none are chosen: all of up to 8, else the first two, the middle
    one and the last two."""
    if num_ranks <= MAX_DRAWN_RANKS:
        return tuple(range(num_ranks))
    return tuple(sorted({0, 1, num_ranks // 2, num_ranks - 2, num_ranks - 1}))


def drawn_ranks(ranks: Sequence[int] | None, num_ranks: int) -> tuple[int, ...]:
    """``ranks`` checked, without repeats and in increasing order (``None``: the default)."""
    if ranks is None:
        return default_ranks(num_ranks)
    chosen = sorted({operator.index(r) for r in ranks})
    if not chosen:
        raise ValueError("ranks must name at least one rank")
    outside = [r for r in chosen if not 0 <= r < num_ranks]
    if outside:
        raise ValueError(f"ranks {outside} are not in the pipeline's ranks 0-{num_ranks - 1}")
    return tuple(chosen)


def grid_width(width: int | None) -> int:
    """``width`` checked; ``None``: the terminal's width (100 without one), at least 60."""
    if width is None:
        return max(DEFAULT_MIN_WIDTH, shutil.get_terminal_size((100, 24)).columns)
    width = operator.index(width)
    if width < MIN_WIDTH:
        raise ValueError(f"width must be >= {MIN_WIDTH} characters, got {width}")
    return width


def _wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters, its indent kept on every line."""
    indent = text[:len(text) - len(text.lstrip())]
    return textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False) or [text]


def _band_ends(cells: list[list[Cell]], total: int, per_band: int) -> list[int]:
    """End slot of each band: at most ``per_band`` slots, ending in the band's second half
    where the fewest drawn cells are cut (the latest such slot)."""
    cuts = Counter(slot for row in cells for first, end, _ in row
                   for slot in range(first + 1, end))
    ends, start = [], 0
    while start < total:
        last = min(total, start + per_band)
        if last < total:
            last = min(range(last, start + per_band // 2, -1), key=lambda b: cuts[b])
        ends.append(last)
        start = last
    return ends


def _band_row(row: list[Cell], start: int, stop: int, column: int) -> tuple[str, bool]:
    """One rank's cells within slots [start, stop), and whether a cell was cut."""
    text, at, cut = "", start, False
    for first, end, label in row:
        if end <= start or first >= stop:
            continue
        lo, hi = max(first, start), min(end, stop)
        chars = column * (hi - lo)
        head = "<" if first < start else ""
        tail = "|" if end <= stop else ">"
        cut = cut or first < start or end > stop
        # A piece too short for the label leaves it to the cell's other pieces (never cut).
        body = head + label if len(head + label) < chars else head
        text += " " * (column * (lo - at)) + body.ljust(chars - 1) + tail
        at = hi
    return text.rstrip(), cut


def render_grid(
    schedule: Schedule,
    timeline: Timeline | None = None,
    time_unit: float | None = None,
    ranks: Sequence[int] | None = None,
    width: int | None = None,
) -> str:
    """Render ``schedule`` as a rank-by-time grid followed by a per-rank summary table.

    ``timeline`` defaults to ``simulate(schedule)`` with the default costs (F=1, B=2, W=1).
    ``time_unit`` is the duration of one column; by default the shortest action. ``ranks``
    are the ranks drawn (grid rows and table rows); by default all of up to 8 ranks, else the
    first two, the middle one and the last two. ``width`` bounds the length of every grid
    line: the time axis is wrapped into bands that fit; by default the terminal's width (100
    without one), at least 60.
    """
    if timeline is None:
        timeline = simulate(schedule, ActionCosts())
    if len(timeline.ranks) != schedule.num_ranks:
        raise ValueError(
            f"timeline has {len(timeline.ranks)} ranks, schedule has {schedule.num_ranks}"
        )
    durations = [t.end - t.start for rank in timeline.ranks for t in rank if t.end > t.start]
    if time_unit is None:
        time_unit = min(durations, default=1.0)
    if time_unit <= 0:
        raise ValueError(f"time_unit must be > 0, got {time_unit}")
    shown = drawn_ranks(ranks, schedule.num_ranks)
    width = grid_width(width)

    slots = _slots(timeline, time_unit)
    cells: list[list[Cell]] = []
    for rank in shown:
        stages = stages_of_rank(schedule, rank)
        second = stages[-1] if len(stages) > 1 else None
        cells.append([(first, end, cell_label(a, second)) for first, end, a in slots[rank]])
    # Narrowest column in which every label plus its '|' fits in the slots it spans.
    column = max((-(-(len(label) + 1) // (end - first))
                  for row in cells for first, end, label in row), default=1)

    lines = _wrap(
        f"schedule {schedule.name}: {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} micro-batches; one column = {time_unit:g}", width)
    if len(shown) < schedule.num_ranks:
        lines += _wrap(f"ranks drawn: {format_ranks(shown)} of {schedule.num_ranks}; pick others "
                       "with ranks=[...] (plan.schedule_grid, render_grid)", width)
    digits = max(2, len(str(schedule.num_ranks - 1)))
    prefix = [f"rank {rank:>{digits}} | " for rank in shown]
    total = max((row[-1][1] for row in cells if row), default=0)
    ends = _band_ends(cells, total, max(1, (width - len(prefix[0])) // column)) or [0]
    any_cut = False
    for band, stop in enumerate(ends):
        start = ends[band - 1] if band else 0
        if len(ends) > 1:
            lines += ([""] if band else []) + [
                f"columns {start}-{stop - 1}, from t = {start * time_unit:g}:"]
        for label, row in zip(prefix, cells, strict=True):
            text, cut = _band_row(row, start, stop, column)
            any_cut = any_cut or cut
            lines.append(f"{label}{text}".rstrip())
    if any_cut:
        lines += _wrap("a cell cut by a band's edge ends in '>' and goes on after '<' in the "
                       "next band", width)
    return "\n".join(lines) + "\n\n" + summary_table(schedule, timeline, shown)


def summary_table(schedule: Schedule, timeline: Timeline,
                  ranks: Sequence[int] | None = None) -> str:
    """Per-rank table (``ranks``, default all): stages, busy time, bubble, bubble ratio and
    peak activations."""
    rows = []
    for rank in range(schedule.num_ranks) if ranks is None else ranks:
        rows.append([
            rank,
            ",".join(str(s) for s in stages_of_rank(schedule, rank)),
            timeline.busy[rank],
            timeline.rank_bubbles[rank],
            f"{100 * timeline.bubble_ratio(rank):.1f}%",
            timeline.peak_activations[rank],
        ])
    table = tabulate(
        rows,
        headers=["rank", "stages", "busy", "bubble", "bubble ratio", "peak activations"],
        floatfmt="g",
    )
    return f"{table}\nmakespan {timeline.makespan:g}, largest bubble {timeline.bubble:g}"


def info_schedule(info: PipelineInfo) -> Schedule:
    """The compute-only schedule a ``PipelineInfo`` keeps (its ``actions`` parsed)."""
    return Schedule(
        name=info.schedule, num_ranks=info.num_ranks, num_stages=info.num_stages,
        num_microbatches=info.num_microbatches, placement=info.placement,
        actions=tuple(tuple(Action.parse(a) for a in rank) for rank in info.actions))


def pipeline_grid(info: PipelineInfo, ranks: Sequence[int] | None = None,
                  width: int | None = None) -> str:
    """The schedule grid of ``info`` drawn again for ``ranks``, wrapped at ``width``.

    The timeline is simulated again with the stage costs the grid was drawn with
    (``info.stage_costs``), so the cells are the same as in ``info.grid``. An info without
    them (made before they were kept) is drawn with F=1, B=2, W=1 on every stage, and says so.
    """
    schedule = info_schedule(info)
    width = grid_width(width)
    if info.stage_costs:
        timeline = simulate(schedule, ActionCosts(stages=info.stage_costs))
        legend = info.grid_legend
    else:
        timeline = simulate(schedule, ActionCosts())
        legend = ("time unit: one forward; this plan keeps no stage costs, so every stage is "
                  "drawn with F=1, B=2, W=1")
    text = render_grid(schedule, timeline, info.grid_time_unit or None, ranks=ranks,
                       width=width)
    wrapped = [part for line in legend.splitlines() for part in _wrap(line, width)]
    return "\n".join([text, *wrapped])
