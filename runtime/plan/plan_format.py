"""The pieces ``str(plan)`` is made of: units, rank sets, grouped rows, tables with legends.

Sizes are bytes in B/KiB/MiB/GiB (``human_bytes``), counts get a k/M/G suffix
(``human_count``). A table (``table``) shows at most ``MAX_ROWS`` rows unless asked for all;
the line under a cut table says how many rows are left out and how to see them
(``str(plan.full())``, ``--full``). Its legend, a line or two of units and meanings, follows.

Per-rank tables show consecutive rows whose figures are all the same as one row, labelled
with its ranks in compact form (``0-7``, ``0,2``, ``0-3,8-11``), so a plan for hundreds of ranks
stays a few rows long; ``GROUPED_NOTE`` under such a table says so.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

from tabulate import tabulate

if TYPE_CHECKING:
    from zeroc.runtime.plan.records import MemoryEstimate

__all__ = [
    "GROUPED_NOTE", "MAX_ROWS", "MORE_HINT", "WIDTH", "format_ranks", "group_identical",
    "human_bytes", "human_count", "legend", "memory_groups", "rank_label", "shape_text",
    "stat_text", "table", "wrap",
]

# Rows a table shows in ``str(plan)``; ``str(plan.full())`` shows every row.
MAX_ROWS = 16
# Header and legend lines are wrapped to this many characters.
WIDTH = 100
MORE_HINT = "every row: str(plan.full()), or --full with python -m zeroc explain"
GROUPED_NOTE = ("  rows are grouped when identical: consecutive ranks with the same figures share "
                "one row\n  (0-7: ranks 0 to 7; 0,2: ranks 0 and 2)")

Row = TypeVar("Row")


def format_ranks(ranks: Iterable[int]) -> str:
    """A set of ranks in compact form: runs as ``a-b``, joined by ``,`` (``0-3,8,10-11``)."""
    ordered = sorted(set(ranks))
    runs: list[list[int]] = []
    for rank in ordered:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def group_identical(rows: Iterable[tuple[int, Row]]) -> list[tuple[tuple[int, ...], Row]]:
    """``(rank, row)`` pairs with consecutive equal rows merged into ``(ranks, row)``."""
    groups: list[tuple[list[int], Row]] = []
    for rank, row in rows:
        if groups and groups[-1][1] == row:
            groups[-1][0].append(rank)
        else:
            groups.append(([rank], row))
    return [(tuple(ranks), row) for ranks, row in groups]


def memory_groups(
    memory: Sequence[MemoryEstimate],
) -> list[tuple[tuple[int, ...], MemoryEstimate]]:
    """Consecutive estimates equal in every field but ``rank``, as (ranks, first estimate)."""
    def figures(m: MemoryEstimate) -> tuple[object, ...]:
        return tuple(getattr(m, f.name) for f in dataclasses.fields(m) if f.name != "rank")

    groups = group_identical((i, figures(m)) for i, m in enumerate(memory))
    return [(tuple(memory[i].rank for i in rows), memory[rows[0]]) for rows, _ in groups]


def rank_label(ranks: Sequence[int]) -> int | str:
    """A table's rank cell: the rank itself, or the group in compact form."""
    return ranks[0] if len(ranks) == 1 else format_ranks(ranks)


def human_bytes(n: int) -> str:
    """Bytes as B/KiB/MiB/GiB with one decimal."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_count(n: int) -> str:
    """A count with a k/M/G suffix."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def shape_text(shape: Sequence[int]) -> str:
    """A shape as ``64x32`` (``scalar`` for a 0-d tensor)."""
    return "x".join(map(str, shape)) or "scalar"


def _is_byte_count(key: str) -> bool:
    return key == "bytes" or key.endswith("_bytes") or key.startswith("bytes_")


def stat_text(key: str, value: str) -> str:
    """A pass statistic as ``key=value``; a byte count (``*_bytes``, ``bytes_*``) in KiB/MiB."""
    if _is_byte_count(key) and value.lstrip("-").isdigit():
        return f"{key}={human_bytes(int(value))}"
    return f"{key}={value}"


def wrap(text: str, indent: str = "", width: int = WIDTH) -> str:
    """``text`` wrapped at ``width``, every line after the first indented by ``indent``."""
    return "\n".join(textwrap.wrap(text, width, subsequent_indent=indent,
                                   break_on_hyphens=False, break_long_words=False))


def legend(text: str) -> str:
    """A table's legend: ``text`` indented by two spaces and wrapped at ``WIDTH``."""
    return "\n".join(textwrap.wrap(text, WIDTH, initial_indent="  ", subsequent_indent="  ",
                                   break_on_hyphens=False, break_long_words=False))


def table(title: str, rows: list[list[object]], headers: list[str], empty: str,
          max_rows: int | None = MAX_ROWS, note: str = "") -> str:
    """A titled table of ``rows`` (at most ``max_rows``; ``None``: all) and its legend
    ``note``; ``title: empty`` when there are no rows."""
    if not rows:
        return f"{title}: {empty}"
    shown = rows if max_rows is None else rows[:max_rows]
    text = tabulate(shown, headers=headers, tablefmt="simple")
    if len(shown) < len(rows):
        text += f"\n... {len(rows) - len(shown)} more rows ({MORE_HINT})"
    if note:
        text += "\n" + legend(note)
    return f"{title}:\n{text}"
