"""What ``zeroc.tune`` searches and where it keeps the winner.

A ``Candidate`` is one layout (ZeRO stage, pipeline degree) with its compile options
(schedule, micro-batches, ``bucket_mb``, ``prefetch``, and the memory-for-time trades
``fused_loss`` and ``partitioner``). ``candidates`` enumerates them for a world size and batch,
defaults first, so a search cut short by its budget has still looked at the usual choices.
``search`` narrows or widens any axis: ``{"zero": [2, 3], "fused_loss": [True]}``.

Quantized collectives (``gather_quant`` for ZeRO-2/3, ``reduce_quant`` for ZeRO-1/2/3) change
the numbers within their error bounds, so they are candidates only when the user allows lossy
options: ``tune(..., lossy=True)`` makes them candidates where the data-parallel link is slow
(``slow_link``: decided from the hardware profile, see ``SLOW_LINK_BYTES_PER_S``);
``search={"gather_quant": [None, "int8"]}`` allows them anywhere, ``[None]`` forbids them.
hpZ (``secondary_shard``, ZeRO-3 at pp=1) is a default candidate,
with groups of one node's devices, where the data-parallel ranks span nodes: the backward's
gathers then stay inside the node. Optimizer offload
(``search={"offload": [None, "optimizer"]}``) is not a default candidate: ``tune`` tries it
(``offload_variants``) only when no layout fits the device without it.

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

__all__ = ["Candidate", "SEARCH_AXES", "SLOW_LINK_BYTES_PER_S", "candidates", "model_key",
           "offload_variants", "slow_link"]

log = logging.getLogger(__name__)

SEARCH_AXES = ("zero", "pp", "schedule", "microbatches", "bucket_mb", "prefetch", "fused_loss",
               "partitioner", "gather_quant", "reduce_quant", "secondary_shard", "offload")
# A data-parallel link at most this fast (bytes per second per device: 100 Gbit/s) makes the
# quantized collectives default candidates.
SLOW_LINK_BYTES_PER_S = 12.5e9


def _axis(search: dict[str, Any], name: str, default: list[Any]) -> list[Any]:
    values = search.get(name, default)
    if not isinstance(values, (list, tuple)) or not values:
        raise OptionError(f"zeroc.tune: search[{name!r}] is {values!r}; give a non-empty list")
    return list(values)


def slow_link(world: int, pp: int, hardware: Any) -> bool:
    """Whether ``world // pp`` data-parallel ranks talk over a link of at most
    ``SLOW_LINK_BYTES_PER_S`` on ``hardware`` (between nodes when they span more than one)."""
    spans = world // pp > hardware.devices_per_node
    rate = hardware.inter_node_bytes_per_s if spans else hardware.intra_node_bytes_per_s
    return rate <= SLOW_LINK_BYTES_PER_S


def _quantized(search: dict[str, Any], zero: int, slow: bool) -> list[dict[str, Any]]:
    """The quantization options of a ZeRO ``zero`` layout: exact first."""
    gathers = _axis(search, "gather_quant", [None, "int8"] if slow else [None]) \
        if zero >= 2 else [None]
    reduces = _axis(search, "reduce_quant", [None, "int4"] if slow else [None]) \
        if zero >= 1 else [None]
    return [{k: v for k, v in (("gather_quant", g), ("reduce_quant", r)) if v is not None}
            for g in gathers for r in reduces]


def _secondary_shards(search: dict[str, Any], zero: int, pp: int, dp: int,
                      hardware: Any) -> list[int | None]:
    """hpZ's group sizes for a layout: ``search["secondary_shard"]``, by default the devices
    of a node where ZeRO-3's data-parallel ranks span nodes (none first); only values that
    divide ``dp`` and are smaller than it, and only for ZeRO-3 at pp=1."""
    per_node = getattr(hardware, "devices_per_node", 0) if hardware is not None else 0
    spans = zero == 3 and pp == 1 and per_node and dp > per_node and dp % per_node == 0
    wanted = _axis(search, "secondary_shard", [None, per_node] if spans else [None])
    if zero != 3 or pp != 1:
        return [None]
    return list(dict.fromkeys(k if k is None or (1 < k < dp and dp % k == 0) else None
                              for k in wanted))


def _offloads(search: dict[str, Any], zero: int, pp: int) -> list[str | None]:
    """``parallelize``'s offload values for a layout: ``search["offload"]`` (default: none)
    where offload runs (ZeRO-2/3 at pp=1), else none."""
    wanted = _axis(search, "offload", [None])
    return list(dict.fromkeys(o if zero >= 2 and pp == 1 else None for o in wanted))


def offload_variants(space: list[Candidate]) -> list[Candidate]:
    """The layouts of ``space`` that can offload the optimizer, offloading it: what ``tune``
    tries when nothing fits the device without."""
    return list(dict.fromkeys(
        Candidate(c.zero, c.pp, c.options, "optimizer") for c in space
        if c.zero >= 2 and c.pp == 1 and c.offload is None))


def candidates(world: int, batch: int, search: dict[str, Any] | None = None,
               hardware: Any = None, lossy: bool = False) -> list[Candidate]:
    """Every candidate for ``world`` ranks at a global ``batch`` (rows of one replica's
    example), defaults first. Pipelines need a batch their micro-batches divide.
    ``hardware``: the profile whose link speed decides whether quantized collectives are
    default candidates (``slow_link``) when ``lossy`` allows them."""
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
                    slow = lossy and hardware is not None and slow_link(world, pp, hardware)
                    quantized = _quantized(search, zero, slow)
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
                                    hpz = [{"secondary_shard": k} if k else {} for k in
                                           _secondary_shards(search, zero, pp, dp, hardware)]
                                    for quant in quantized:
                                        for secondary in hpz:
                                            for offload in _offloads(search, zero, pp):
                                                found.append(Candidate(zero, pp, tuple(sorted(
                                                    {**options, **quant,
                                                     **secondary}.items())), offload))
    if not found:
        raise OptionError(f"zeroc.tune: no candidate for world={world} and batch={batch} "
                          f"with search={search!r} (micro-batches must divide the batch)")
    return list(dict.fromkeys(found))
