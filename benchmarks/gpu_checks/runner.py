"""Run the sections of ``benchmarks/gpu_check.py`` within a time budget and record each one.

A ``Section`` is a name, a function ``run(ctx, budget) -> dict`` of figures, its own budget in
seconds and the least time it needs to be worth starting. ``run_sections`` runs them in order
against one overall ``Budget``: a section starts only when it is selected, the device it needs
is there and at least ``min_s`` of the overall budget are left; it then gets
``min(budget_s, overall seconds left)`` (no limit when the overall budget has none) and is
expected to stop starting new work once that is spent (a compile already under way cannot be
cut short, so a section may end a little past it: ``over_budget`` says so). An exception
ends only its own section: its type, message and traceback are recorded and the next section
runs. A section raises ``SkipSection`` to say it
cannot run here (with the reason); figures with ``"ok": False`` mark a check that failed.

Each section's record: ``status`` (``ok``, ``check_failed``, ``error`` or ``skipped``),
``reason`` (why it was skipped), ``error`` (``{"type", "message", "traceback"}``),
``budget_s``, ``wall_s``, ``over_budget`` and ``figures``. ``write_json`` writes the whole
result as strict JSON (NaN and infinities become the strings ``"nan"``, ``"inf"``).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import os
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch

logger = logging.getLogger(__name__)

STATUSES = ("ok", "check_failed", "error", "skipped")


class SkipSection(Exception):  # noqa: N818 -- it says what happens, not that it went wrong
    """Raised by a section that cannot run here; its message is the recorded reason."""


class Budget:
    """Seconds since construction against a limit; a limit of 0 or less never runs out.

    ``clock`` (default ``time.perf_counter``) is injectable so that tests need not wait.
    Same interface as ``gpu_step.Budget`` (``seconds``, ``elapsed``, ``spent``), so either
    can be handed to ``gpu_step.run_variants`` and ``gpu_kernels.run_kernels``."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds = float(seconds)
        self.clock = clock
        self.start = clock()

    def elapsed(self) -> float:
        """Seconds since the budget started."""
        return self.clock() - self.start

    def left(self) -> float:
        """Seconds left (``math.inf`` without a limit; never below 0)."""
        return math.inf if self.seconds <= 0 else max(0.0, self.seconds - self.elapsed())

    def spent(self, estimate_s: float = 0.0) -> bool:
        """Whether no new work should start: the limit is reached, or work expected to take
        ``estimate_s`` (e.g. the longest like it so far) would end past it."""
        return self.seconds > 0 and self.elapsed() + estimate_s >= self.seconds


@dataclasses.dataclass(frozen=True)
class Section:
    """One part of the check: ``run(ctx, budget)`` returns its figures."""

    name: str
    run: Callable[[Any, Budget], dict[str, Any]]
    budget_s: float
    min_s: float
    needs_cuda: bool = True
    doc: str = ""


def error_record(error: BaseException) -> dict[str, str]:
    """``{"type", "message", "traceback"}`` of ``error`` (call inside its ``except``)."""
    return {"type": type(error).__name__, "message": str(error),
            "traceback": traceback.format_exc()}


def skip_reason(section: Section, selected: Iterable[str], cuda: bool, smoke: bool,
                overall: Budget) -> str | None:
    """Why ``section`` does not start, or ``None`` when it does."""
    if section.name not in selected:
        return "not selected (--sections)"
    if not cuda and not smoke:
        return no_cuda_reason()
    if not cuda and section.needs_cuda:
        return "needs a CUDA device; --cpu-smoke runs on the CPU"
    left = overall.left()
    if left < section.min_s:
        return (f"overall budget spent: {left:.0f} s of {overall.seconds:g} s left, the section "
                f"needs at least {section.min_s:g} s")
    return None


def no_cuda_reason() -> str:
    """The reason recorded for every section when there is no CUDA device."""
    return (f"no CUDA device is available (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}); this check runs on a GPU")


def run_section(section: Section, ctx: Any, budget: Budget) -> dict[str, Any]:
    """Run one section within ``budget``; never raises (an ``Exception`` is recorded)."""
    record: dict[str, Any] = {"status": "ok", "reason": None, "error": None,
                              "budget_s": budget.seconds, "wall_s": None, "over_budget": False,
                              "figures": {}}
    try:
        figures = section.run(ctx, budget)
        record["figures"] = figures
        if figures.get("ok") is False:
            record["status"] = "check_failed"
            record["reason"] = figures.get("reason")
    except SkipSection as skip:
        record.update(status="skipped", reason=str(skip))
    except Exception as error:  # one section's failure is recorded, the others still run
        record.update(status="error", error=error_record(error))
        logger.error("section %s failed:\n%s", section.name, record["error"]["traceback"])
    record["wall_s"] = budget.elapsed()
    record["over_budget"] = bool(budget.seconds > 0 and record["wall_s"] > budget.seconds)
    return record


def synchronize(device: str) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def release_memory() -> None:
    """Drop compiled code and free cached device memory between sections."""
    torch.compiler.reset()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_sections(sections: list[Section], ctx: Any, overall: Budget, selected: Iterable[str],
                 cuda: bool, smoke: bool = False, cleanup: Callable[[], None] = release_memory
                 ) -> dict[str, dict[str, Any]]:
    """Every section's record, in order (see the module docstring)."""
    selected = set(selected)
    records: dict[str, dict[str, Any]] = {}
    for section in sections:
        reason = skip_reason(section, selected, cuda, smoke, overall)
        if reason is not None:
            logger.debug("section %s: skipped (%s)", section.name, reason)
            records[section.name] = {"status": "skipped", "reason": reason, "error": None,
                                     "budget_s": section.budget_s, "wall_s": 0.0,
                                     "over_budget": False, "figures": {}}
            continue
        # No overall limit (``--time-budget-s 0``): no section limit either, so every
        # variant of a section runs however slow the machine is (the CPU smoke tests).
        limit = min(section.budget_s, overall.left()) if overall.seconds > 0 else 0.0
        budget = Budget(limit, overall.clock)
        logger.info("section %s: %s (budget %.0f s)", section.name, section.doc,
                    budget.seconds)
        records[section.name] = record = run_section(section, ctx, budget)
        logger.info("section %s: %s in %.1f s%s", section.name, record["status"],
                    record["wall_s"], f" ({record['reason']})" if record["reason"] else "")
        try:
            cleanup()
        except Exception:  # cleaning up must not stop the next section
            logger.warning("cleanup after section %s failed", section.name, exc_info=True)
    return records


def overall_status(records: dict[str, dict[str, Any]]) -> str:
    """``error`` if any section raised, else ``check_failed`` if any check failed, else ``ok``
    if any section ran, else ``skipped``."""
    statuses = {r["status"] for r in records.values()}
    for status in ("error", "check_failed", "ok"):
        if status in statuses:
            return status
    return "skipped"


def plain(value: Any) -> Any:
    """``value`` as strict JSON values: dataclasses and mappings to dicts, tuples to lists,
    dtypes and other objects to strings, non-finite floats to ``"nan"``/``"inf"``/``"-inf"``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write ``plain(payload)`` to ``path`` (its directory is created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(plain(payload), handle, indent=1, allow_nan=False)
