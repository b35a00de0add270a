"""zeroc's logging: the ``zeroc`` logger under ``TORCH_LOGS``, compile summaries and progress.

Every module logs through ``logging.getLogger(__name__)``, so all of them sit under the
``zeroc`` logger (``zeroc.frontend.capture``, ``zeroc.passes.base``, ``zeroc.runtime.executor``...).
``register_logging`` (run when ``zeroc`` is imported) registers that logger with torch's
logging registry, as torch's own components are: ``TORCH_LOGS="zeroc"`` shows zeroc's INFO
lines, ``TORCH_LOGS="+zeroc"`` its DEBUG lines too, and ``torch._logging.set_logs(modules=
{"zeroc": logging.INFO})`` does the same from code. Without either, zeroc's loggers are left
to the application's logging configuration (nothing is shown at the default WARNING level).

At INFO each compiled graph gets one line: its compile time and what the passes decided
(ZeRO buckets, fused kernels, recomputation; for a pipeline its stages and schedule). At
DEBUG every pass's stats follow (``zeroc.passes.base.run_passes``). A compile running longer
than ``PROGRESS_AFTER_S`` seconds reports its progress (graph i of n, stage k of S) at INFO,
on rank 0 only.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable

import torch.distributed as dist

from zeroc.runtime.plan.records import PassInfo

log = logging.getLogger(__name__)

LOGGER_NAME = "zeroc"
SETTING_NAME = "zeroc"
# Progress lines reach INFO once a compile has run this long (before: DEBUG only).
PROGRESS_AFTER_S = 3.0


def env_level(settings: str | None) -> int | None:
    """The level ``TORCH_LOGS`` asks of zeroc: INFO for ``zeroc``, DEBUG for ``+zeroc``,
    ERROR for ``-zeroc`` (the last mention wins); None when it does not name ``zeroc``."""
    if not settings:
        return None
    level = None
    for token in settings.strip().strip("\"'").replace(" ", "").split(","):
        if token.lstrip("+-") != SETTING_NAME:
            continue
        level = (logging.DEBUG if token.startswith("+") else
                 logging.ERROR if token.startswith("-") else logging.INFO)
    return level


def _torch_importing() -> bool:
    """Whether ``import torch`` is still running (torch's TORCH_LOGS parsing imports the
    module it names, so ``TORCH_LOGS=zeroc`` imports zeroc from inside torch's import)."""
    torch_module = sys.modules.get("torch")
    return bool(getattr(getattr(torch_module, "__spec__", None), "_initializing", False))


def register_logging() -> None:
    """Put the ``zeroc`` logger under torch's logging controls (see the module docstring).

    Idempotent. When ``TORCH_LOGS`` names zeroc and torch has not already set the logger up
    (``TORCH_LOGS`` set after torch was imported), its level and torch's handler are applied
    here, as torch's ``_init_logs`` would have.
    """
    from zeroc.runtime.torch_compat import (
        add_torch_log_handler,
        register_torch_log,
        torch_logs_env_var,
    )

    try:
        register_torch_log(SETTING_NAME, LOGGER_NAME)
    except (AttributeError, TypeError) as error:  # a torch whose registry differs
        log.debug("zeroc: cannot register with torch's logging registry: %s", error)
        return
    level = env_level(os.environ.get(torch_logs_env_var()))
    if level is None:
        return
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    logger.propagate = False  # as torch's registered loggers: its handler prints the line
    if _torch_importing():
        return  # torch's _init_logs, running now, adds its handler to every registered log
    add_torch_log_handler(logger)


def is_rank_zero() -> bool:
    """Rank 0 of the default process group, or no process group at all."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class CompileProgress:
    """Times one compile; ``step`` reports progress at INFO on rank 0 once it runs long.

    ``lap`` returns the seconds since the previous lap (or the start), so the per-graph
    times a compile logs add up to its whole time.
    """

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.logger = logger
        self.what = what
        self.start = self._last = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since the compile started."""
        return time.perf_counter() - self.start

    def lap(self) -> float:
        """Seconds since the last lap (the first: since the start)."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        return seconds

    def step(self, message: str, *args: object) -> None:
        """Log ``zeroc: <what>: compiling <message>``: INFO on rank 0 after
        ``PROGRESS_AFTER_S`` seconds, DEBUG otherwise."""
        elapsed = self.elapsed()
        level = (logging.INFO if elapsed >= PROGRESS_AFTER_S and is_rank_zero()
                 else logging.DEBUG)
        if self.logger.isEnabledFor(level):
            self.logger.log(level, "zeroc: %s: compiling " + message + ", %.1f s so far",
                            self.what, *args, elapsed)


def _numbers(infos: Iterable[PassInfo], pass_name: str) -> dict[str, int]:
    """The integer stats of ``pass_name`` summed over ``infos``."""
    totals: dict[str, int] = {}
    for info in infos:
        if info.pass_name != pass_name:
            continue
        for key, value in info.stats:
            if value.lstrip("-").isdigit():
                totals[key] = totals.get(key, 0) + int(value)
    return totals


def decisions(infos: Iterable[PassInfo]) -> str:
    """What the passes decided, in a few words: ZeRO buckets, fused kernels, recomputation.

    ``"ZeRO buckets: 2 gathers, 2 reductions; 6 fused kernels (17 ops)"``; ``"no changes"``
    when the passes decided nothing worth a word.
    """
    infos = list(infos)
    parts = []
    loss = _numbers(infos, "fuse_linear_cross_entropy").get("rewritten", 0)
    if loss:
        parts.append(f"{loss} fused LM-head loss{'es' if loss > 1 else ''}")
    zero = _numbers(infos, "lower_zero")
    gathers, reduces = zero.get("gather_buckets", 0), zero.get("reduce_buckets", 0)
    if gathers or reduces:
        parts.append(f"ZeRO buckets: {gathers} gathers, {reduces} reductions")
    if zero.get("whole_params", 0):
        parts.append(f"{zero['whole_params']} whole parameters")
    regathers = _numbers(infos, "tag_zero_recompute").get("tagged", 0)
    if regathers:
        parts.append(f"{regathers} gathers recomputed in the backward")
    recomputed = _numbers(infos, "tag_activation_recompute").get("tagged", 0)
    if recomputed:
        parts.append(f"{recomputed} activations recomputed")
    fusion = _numbers(infos, "fusion")
    if fusion.get("kernels", 0):
        parts.append(f"{fusion['kernels']} fused kernels ({fusion.get('fused_ops', 0)} ops)")
    return "; ".join(parts) if parts else "no changes"
