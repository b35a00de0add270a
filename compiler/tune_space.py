"""What ``zeroc.tune`` searches and where it keeps the winner.

A ``Candidate`` is one layout (ZeRO stage, pipeline degree) with its compile options
(schedule, micro-batches, ``bucket_mb``, ``prefetch``, and the memory-for-time trades
``fused_loss`` and ``partitioner``). ``candidates`` enumerates them for a world size and batch,
defaults first, so a search cut short by its budget has still looked at the usual choices.
``search`` narrows or widens any axis: ``{"zero": [2, 3], "fused_loss": [True]}``.

The winner is cached as JSON under ``<cache_dir>/tune/``, one file per (model structure and
inputs, world, device), and once more per (model structure, world, device) as the ``.layout``
file ``parallelize(layout="auto")`` reads: ``model_key`` hashes the module classes, parameter
names, shapes and dtypes and the example inputs' shapes (what decides the compiled graphs). A
file written by another torch or zeroc version, or for other inputs, is ignored with a log
line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any

import torch
from torch import nn

from zeroc.codegen.cache_files import atomic_write, private_dir, resolve_cache_dir
from zeroc.config import SCHEDULES, Config
from zeroc.runtime.errors import OptionError

__all__ = ["Candidate", "SEARCH_AXES", "candidates", "layout_path", "model_key", "read_cached",
           "read_layout", "read_on_rank0", "write_cached"]

log = logging.getLogger(__name__)

TUNE_FORMAT = 1
SEARCH_AXES = ("zero", "pp", "schedule", "microbatches", "bucket_mb", "prefetch", "fused_loss",
               "partitioner")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout and its compile options."""

    zero: int
    pp: int
    options: tuple[tuple[str, Any], ...] = ()

    def options_dict(self) -> dict[str, Any]:
        """The compile options for ``torch.compile(..., backend="zeroc", options=...)``."""
        return dict(self.options)

    def label(self) -> str:
        """A short readable name: ``zero3 pp1 fused_loss=False``."""
        parts = [f"zero{self.zero}", f"pp{self.pp}"]
        parts += [f"{k}={v}" for k, v in self.options]
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        """JSON-able form (``from_json`` inverts it)."""
        return {"zero": self.zero, "pp": self.pp, "options": dict(self.options)}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Candidate:
        """Inverse of ``to_json``."""
        return Candidate(int(data["zero"]), int(data["pp"]),
                         tuple(sorted(dict(data.get("options", {})).items())))


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


def model_key(model: nn.Module, example_inputs: Any) -> str:
    """A hash of what decides the compiled graphs: module classes, parameters, input shapes."""
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        digest.update(f"{name}:{type(module).__qualname__};".encode())
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
    values = example_inputs.values() if isinstance(example_inputs, dict) else (
        example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,))
    for value in values:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else repr(value)
        digest.update(f"in:{shape};".encode())
    return digest.hexdigest()[:16]


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        zeroc_version = version("zeroc")
    except PackageNotFoundError:
        zeroc_version = "unknown"
    return {"torch": torch.__version__, "zeroc": zeroc_version, "format": str(TUNE_FORMAT)}


def cache_path(cache_dir: str | None, key: str, world: int, device: str) -> str:
    """``<cache_dir>/tune/<model key>-w<world>-<device>.json``."""
    return os.path.join(resolve_cache_dir(cache_dir), "tune", f"{key}-w{world}-{device}.json")


def read_cached(path: str) -> dict[str, Any] | None:
    """The cached result at ``path``, or None (absent, unreadable, or from other versions)."""
    try:
        with open(path) as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        log.warning("zeroc.tune: ignoring the unreadable cache file %s (%s)", path, error)
        return None
    versions = data.get("versions") if isinstance(data, dict) else None
    if versions != _versions():
        log.info("zeroc.tune: ignoring %s: tuned with %s, this is %s", path, versions,
                 _versions())
        return None
    try:
        Candidate.from_json(data["best"])
    except (KeyError, TypeError, ValueError) as error:
        log.warning("zeroc.tune: ignoring the malformed cache file %s (%s)", path, error)
        return None
    return data


def layout_path(cache_dir: str | None, model: nn.Module, world: int, device: str) -> str:
    """Where ``parallelize(layout="auto")`` looks: the last layout tuned for this model
    structure (whatever its inputs) on ``world`` ranks of ``device``."""
    key = model_key(model, ())
    return os.path.join(resolve_cache_dir(cache_dir), "tune", f"{key}-w{world}-{device}.layout")


def write_cached(path: str, best: Candidate, trials: list[dict[str, Any]],
                 layout_file: str | None = None) -> None:
    """Store the winner and the trial table at ``path`` (atomically), and the winner alone at
    ``layout_file`` (for ``parallelize(layout="auto")``)."""
    directory = os.path.dirname(path)
    private_dir(os.path.dirname(directory), os.path.basename(directory))
    payload = {"versions": _versions(), "best": best.to_json(), "trials": trials}
    atomic_write(path, json.dumps(payload, indent=1))
    if layout_file is not None:
        atomic_write(layout_file, json.dumps(
            {"versions": _versions(), "best": best.to_json(), "source": path}, indent=1))


def read_on_rank0(reader: Any, path: str) -> Any:
    """``reader(path)`` on global rank 0, the same value on every rank.

    Every rank must act on one answer: with a cache directory per node (the default is in
    the home directory), ranks reading their own files would disagree (one tunes with
    collectives while another returns, or two layouts meet). Only rank 0 writes, so only
    rank 0 reads, and its answer is broadcast."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return reader(path)
    found = [reader(path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)
    return found[0]


def read_layout(path: str) -> tuple[Candidate, str] | None:
    """The winner in the ``.layout`` file at ``path`` and the cache file it came from, or None
    (absent, unreadable, or from other versions: logged)."""
    try:
        with open(path) as handle:
            data = json.load(handle)
        if data.get("versions") != _versions():
            log.info("zeroc: ignoring the tuned layout %s: tuned with %s, this is %s", path,
                     data.get("versions"), _versions())
            return None
        return Candidate.from_json(data["best"]), str(data.get("source", path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        log.warning("zeroc: ignoring the unreadable tuned layout %s (%s)", path, error)
        return None
