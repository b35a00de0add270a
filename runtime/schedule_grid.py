"""Text rendering of a pipeline schedule: a rank-by-time grid and a per-rank summary.

The grid draws one row per rank and one column per time slot, like the figure in the DualPipe
paper: each compute action is a cell ``label|`` spanning its simulated duration, and blank
space is bubble. Labels: ``F3`` forward of micro-batch 3, ``B1`` full backward, ``I2``/``W2``
the input- and weight-gradient halves, ``F4&B0`` an overlapped forward and backward. On a
rank that holds two stages (DualPipe, DualPipeV) the rank's higher-numbered stage is written
in lower case (``f3``, ``b1``, ``F4&b0``), so the two streams are told apart without color.
"""

from __future__ import annotations

from tabulate import tabulate

from zeroc.runtime.actions import Action, ActionKind, Schedule
from zeroc.runtime.simulate import ActionCosts, Timeline, simulate


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


def render_grid(
    schedule: Schedule,
    timeline: Timeline | None = None,
    time_unit: float | None = None,
) -> str:
    """Render ``schedule`` as a rank-by-time grid followed by a per-rank summary table.

    ``timeline`` defaults to ``simulate(schedule)`` with the default costs (F=1, B=2, W=1).
    ``time_unit`` is the duration of one column; by default the shortest action.
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

    second = []
    for rank in range(schedule.num_ranks):
        stages = stages_of_rank(schedule, rank)
        second.append(stages[-1] if len(stages) > 1 else None)
    rows = _slots(timeline, time_unit)
    labels = [[cell_label(a, second[r]) for _, _, a in row] for r, row in enumerate(rows)]
    # Narrowest column in which every label plus its '|' fits in the slots it spans.
    width = max((-(-(len(label) + 1) // (end - first))
                 for row, row_labels in zip(rows, labels, strict=True)
                 for (first, end, _), label in zip(row, row_labels, strict=True)), default=1)

    lines = [f"schedule {schedule.name}: {schedule.num_ranks} ranks, {schedule.num_stages} "
             f"stages, {schedule.num_microbatches} micro-batches; one column = {time_unit:g}"]
    for rank, row in enumerate(rows):
        text, at = "", 0
        for (first, end, _), label in zip(row, labels[rank], strict=True):
            text += " " * (width * (first - at))
            text += label.ljust(width * (end - first) - 1) + "|"
            at = end
        lines.append(f"rank {rank:>2} | {text.rstrip()}")
    return "\n".join(lines) + "\n\n" + summary_table(schedule, timeline)


def summary_table(schedule: Schedule, timeline: Timeline) -> str:
    """Per-rank table: stages, busy time, bubble, bubble ratio and peak activations."""
    rows = []
    for rank in range(schedule.num_ranks):
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
