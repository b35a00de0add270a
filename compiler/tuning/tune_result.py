"""What ``zeroc.tune`` returns: each candidate's figures (``Trial``) and the winner
(``TuneResult``), with why it wins and a table of every trial."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from tabulate import tabulate
from torch import nn

from zeroc.runtime.plan.plan_text import human_bytes
from zeroc.tuning.tune_space import Candidate

__all__ = ["TuneResult", "Trial", "spearman"]


@dataclasses.dataclass
class Trial:
    """One candidate's figures; ``rejected`` says why it lost outright (empty: it competed).

    ``estimated_s`` comes from the candidate's plan (``zeroc.explain(world=...)`` on the
    profile), ``screened_s`` from the tuner's screen of a world that is not here
    (``zeroc.tuning.tune_screen``: every candidate is screened, the best are planned),
    ``measured_s`` from real steps. ``peak_bytes`` is the plan's largest rank's peak where
    the candidate was planned, else the screen's."""

    candidate: Candidate
    estimated_s: float | None = None
    peak_bytes: int | None = None
    measured_s: float | None = None
    rejected: str = ""
    # The estimate's parts: compute_s, exposed_communication_s, optimizer_s, bubble.
    parts: dict[str, float] = dataclasses.field(default_factory=dict)
    screened_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"candidate": self.candidate.to_json(), "estimated_s": self.estimated_s,
                "peak_bytes": self.peak_bytes, "measured_s": self.measured_s,
                "rejected": self.rejected, "parts": self.parts,
                "screened_s": self.screened_s}


def _figures(trial: Trial, peak: bool = False) -> str:
    parts = trial.parts
    text = (f"bubble {parts.get('bubble', 0.0):.0%}, exposed communication "
            f"{parts.get('exposed_communication_s', 0.0) * 1e3:.3g} ms")
    if peak and trial.peak_bytes:
        text = f"peak {human_bytes(trial.peak_bytes)}, " + text
    return text


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """The winner, every trial, and whether it came from the cache."""

    best: Candidate
    trials: tuple[Trial, ...]
    from_cache: bool
    cache_file: str
    measured: bool = True  # False: chosen by the estimate alone (a world that is not here)

    def counts(self) -> str:
        """How many candidates were estimated (and of those, how many fit in memory and how
        many were over it) and how many never were (the budget, or a failure to plan)."""
        estimated = [t for t in self.trials if t.peak_bytes]
        over = sum(1 for t in estimated if t.rejected.startswith("needs"))
        return (f"of {len(self.trials)} candidates {len(estimated)} estimated: "
                f"{len(estimated) - over} fit in memory, {over} over it; "
                f"{len(self.trials) - len(estimated)} not estimated")

    def why(self) -> str:
        """Why the winner wins: its memory, bubble and exposed communication against the
        runner-up's, from the estimates (a screened runner-up's when only the winner was
        planned)."""
        by = {t.candidate: t for t in self.trials}
        best = by.get(self.best)
        if best is None or best.estimated_s is None:
            return f"{self.best.label()}: from the cache"
        alive = [t for t in self.trials if not t.rejected and t.candidate != self.best]
        others = sorted((t for t in alive if t.estimated_s is not None),
                        key=lambda t: t.estimated_s)
        text = (f"{self.best.label()}: estimated step {best.estimated_s * 1e3:.4g} ms, peak "
                f"{human_bytes(best.peak_bytes or 0)} ({self.counts()}), {_figures(best)}")
        if others:
            runner = others[0]
            text += (f"; next best {runner.candidate.label()} at "
                     f"{runner.estimated_s * 1e3:.4g} ms ({_figures(runner, peak=True)})")
        else:
            screened = sorted((t for t in alive if t.screened_s is not None),
                              key=lambda t: t.screened_s)
            if screened:
                runner = screened[0]
                text += (f"; next best by the screen {runner.candidate.label()} at "
                         f"{runner.screened_s * 1e3:.4g} ms against the winner's screened "
                         f"{(best.screened_s or 0.0) * 1e3:.4g} ms "
                         f"({_figures(runner, peak=True)}, screened)")
        return text

    def table(self) -> str:
        """The trials as a table: candidate, screened, estimated and measured step, peak,
        why rejected."""
        screened = any(t.screened_s is not None for t in self.trials)

        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value * 1e3:.3g}"

        rows = [[t.candidate.label() + (" *" if t.candidate == self.best else ""),
                 *([ms(t.screened_s)] if screened else []), ms(t.estimated_s),
                 ms(t.measured_s), "-" if t.peak_bytes is None else human_bytes(t.peak_bytes),
                 t.rejected] for t in self.trials]
        headers = ["candidate (* chosen)", *(["screened step (ms)"] if screened else []),
                   "estimated step (ms)", "measured step (ms)", "peak", "rejected"]
        return tabulate(rows, headers=headers)

    def apply(self, model: nn.Module) -> dict[str, Any]:
        """Parallelize ``model`` with the winning layout; return its compile options."""
        from zeroc.sharding.parallelize import parallelize

        parallelize(model, zero=self.best.zero, pp=self.best.pp, offload=self.best.offload)
        return self.best.options_dict()


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation of two lists (average ranks for ties): how alike an
    estimate orders candidates to what it estimates."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2.0
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx and vy else 0.0
