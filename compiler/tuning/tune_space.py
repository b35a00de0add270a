"""What ``zeroc.tune`` searches and where it keeps the winner.

A ``Candidate`` is one layout (ZeRO stage, pipeline degree) with its compile options
(schedule, micro-batches, ``bucket_mb``, ``prefetch``, and the memory-for-time trades
``fused_loss`` and ``partitioner``). ``candidates`` enumerates them for a world size and batch,
defaults first, so a search cut short by its budget has still looked at the usual choices.
``search`` narrows or widens any axis: ``{"zero": [2, 3], "fused_loss": [True]}``.

``model_key`` hashes the module classes, parameter names, shapes and dtypes and the example
inputs' shapes (what decides the compiled graphs): the tune cache (``zeroc.sharding.tune_cache``)
keeps
the winner under it.
"""

from __future__ import annotations

import logging
from typing import Any

from zeroc.frontend.config import SCHEDULES, Config
from zeroc.runtime.errors import OptionError
from zeroc.sharding.layout_candidate import Candidate, model_key  # noqa: F401 (re-exported)

__all__ = ["Candidate", "SEARCH_AXES", "candidates", "model_key"]

log = logging.getLogger(__name__)

SEARCH_AXES = ("zero", "pp", "schedule", "microbatches", "bucket_mb", "prefetch", "fused_loss",
               "partitioner")


def _axis(search: dict[str, Any], name: str, default: list[Any]) -> list[Any]:
    values = search.get(name, default)
    if not isinstance(values, (list, tuple)) or not values:
        raise OptionError(f"zeroc.tune: search[{name!r}] is {values!r}; give a non-empty list")
    return list(values)


def candidates(world: int, batch: int, search: dict[str, Any] | None = None
               ) -> list[Candidate]:
    """Every candidate for ``world`` ranks at a global ``batch`` (rows of one replica's
    example), defaults first. Pipelines need a batch their micro-batches divide."""
    search = dict(search or {})
    unknown = set(search) - set(SEARCH_AXES)
    if unknown:
        raise OptionError(f"zeroc.tune: unknown search axes {sorted(unknown)}; allowed: "
                          f"{', '.join(SEARCH_AXES)}")
    defaults = Config()
    pps = _axis(search, "pp", [p for p in (1, 2, 4, 8) if world % p == 0])
    found: list[Candidate] = []
    for pp in pps:
        if world % pp:
            raise OptionError(f"zeroc.tune: search pp={pp} does not divide the world of {world}")
        dp = world // pp
        zeros = _axis(search, "zero", [3, 2, 0] if dp > 1 else [0])
        schedules = _axis(search, "schedule", ["1f1b", "dualpipev"]) if pp > 1 else [None]
        for schedule in schedules:
            if schedule is not None and schedule not in SCHEDULES:
                raise OptionError(f"zeroc.tune: search schedule={schedule!r}; allowed: "
                                  f"{', '.join(SCHEDULES)}")
            counts = [None]
            if pp > 1:
                low = 2 * pp if schedule in ("dualpipe", "dualpipev") else pp
                counts = [m for m in _axis(search, "microbatches", [low, 2 * low])
                          if batch % m == 0 and m >= low]
            for microbatches in counts:
                for zero in zeros:
                    prefetches = _axis(search, "prefetch", [defaults.prefetch, 0]) \
                        if zero == 3 and pp == 1 else [defaults.prefetch]
                    buckets = _axis(search, "bucket_mb", [defaults.bucket_mb]) \
                        if zero > 0 else [defaults.bucket_mb]
                    for bucket_mb in buckets:
                        for prefetch in prefetches:
                            for fused_loss in _axis(search, "fused_loss", [True, False]):
                                for partitioner in _axis(search, "partitioner",
                                                         ["min_cut", "default"]):
                                    options = {"fused_loss": fused_loss,
                                               "partitioner": partitioner}
                                    if zero > 0:
                                        options["bucket_mb"] = bucket_mb
                                    if zero == 3 and pp == 1:
                                        options["prefetch"] = prefetch
                                    if pp > 1:
                                        options["schedule"] = schedule
                                        options["microbatches"] = microbatches
                                    found.append(Candidate(zero, pp,
                                                           tuple(sorted(options.items()))))
    if not found:
        raise OptionError(f"zeroc.tune: no candidate for world={world} and batch={batch} "
                          f"with search={search!r} (micro-batches must divide the batch)")
    return list(dict.fromkeys(found))
