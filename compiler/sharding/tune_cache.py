"""Where ``zeroc.tune`` keeps its winner, and when ``parallelize(layout="auto")`` applies it.

Two records of ``zeroc.runtime.cached_files`` per tune (the user's own files in private
directories, a format version, a checksum), both under ``<cache_dir>/tune/``:

- ``<model key>-w<world>-<device>.json``: the winner and every trial, keyed by the model's
  structure and input shapes (``zeroc.sharding.layout_candidate.model_key``), the world, the
  device and the torch and zeroc versions; a later ``tune`` of the same returns it;
- ``<structure key>-w<world>-<device>.layout``: the winner alone, keyed by the model's
  structure, the world, the device and the versions, with the input shapes it was tuned for:
  what ``parallelize(layout="auto")`` reads.

A record read back is checked whole: the layout's ZeRO stage and pipeline degree in range (the
degree divides the world), its options only the tuner's own (``TUNABLE_OPTIONS``: never one
that changes what is computed, such as ``loss_reduction``, or where files go, ``cache_dir``;
the quantized collectives change the numbers only within their error bounds, and the tuner
offers them only on a slow link or where ``search`` asks)
with values the compile accepts, every trial's figures finite and non-negative. A record that
fails any check is ignored with one log line, and ``tune`` searches again
(``parallelize(layout="auto")`` raises, naming the directory).

The layout's ZeRO stage and pipeline degree apply at ``parallelize``; its compile options
apply when the model is first compiled, and only if its inputs have the shapes the layout was
tuned for (``tuned_options_for``; otherwise a warning and the defaults). ``zeroc.explain``
says on its first line where the layout came from and what matched (``layout_match``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroc.frontend.config import check_option
from zeroc.runtime.cached_files import (
    RecordError,
    fields,
    integer,
    number,
    read_record,
    resolve_cache_dir,
    text,
    write_record,
)
from zeroc.runtime.errors import OptionError
from zeroc.sharding.layout_candidate import Candidate, model_key

__all__ = ["TUNABLE_OPTIONS", "cache_path", "layout_key", "layout_match", "layout_path",
           "tuned_layout",
           "read_cached", "read_layout", "read_on_rank0", "result_key", "tuned_options_for",
           "write_cached"]

log = logging.getLogger(__name__)

TUNE_FORMAT = 2
# The compile options a tuned layout may carry: the tuner's search axes but zero and pp.
TUNABLE_OPTIONS = ("schedule", "microbatches", "bucket_mb", "prefetch", "fused_loss",
                   "partitioner", "gather_quant", "reduce_quant", "secondary_shard")
_TRIAL_FIELDS = ("candidate", "estimated_s", "peak_bytes", "measured_s", "rejected")
_MAX_SECONDS = 1e6
_MATCHED_ATTR = "_zeroc_tuned_inputs_match"  # on a ZeroLayout: the first compile's verdict


def versions() -> dict[str, str]:
    """The torch and zeroc versions a tune record must have been written with."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        zeroc_version = version("zeroc")
    except PackageNotFoundError:
        zeroc_version = "unknown"
    return {"torch": torch.__version__, "zeroc": zeroc_version}


def cache_path(cache_dir: str | None, key: str, world: int, device: str) -> str:
    """``<cache_dir>/tune/<model key>-w<world>-<device>.json``."""
    return os.path.join(resolve_cache_dir(cache_dir), "tune", f"{key}-w{world}-{device}.json")


def layout_path(cache_dir: str | None, model: nn.Module, world: int, device: str) -> str:
    """Where ``parallelize(layout="auto")`` looks: the last layout tuned for this model
    structure (whatever its inputs) on ``world`` ranks of ``device``."""
    key = model_key(model, ())
    return os.path.join(resolve_cache_dir(cache_dir), "tune", f"{key}-w{world}-{device}.layout")


def result_key(key: str, world: int, device: str) -> dict[str, Any]:
    """What a tune result must have been made for: model and inputs, world, device, versions."""
    return {"model": key, "world": world, "device": device, "versions": versions()}


def layout_key(model: nn.Module, world: int, device: str) -> dict[str, Any]:
    """What a ``.layout`` must have been made for: model structure, world, device, versions."""
    return result_key(model_key(model, ()), world, device)


def input_shapes(example_inputs: Any) -> list[list[int]]:
    """The shapes of the tensors among ``example_inputs`` (a tuple, a dict or one value)."""
    values = example_inputs.values() if isinstance(example_inputs, dict) else (
        example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,))
    return [[int(s) for s in v.shape] for v in values if isinstance(v, torch.Tensor)]


def _root(path: str) -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(path)))


def candidate_from_record(data: Any, world: int, where: str) -> Candidate:
    """The candidate a record holds, when its stage, degree and options are in range."""
    entry = fields(data, where, ("zero", "pp", "options"), ("offload",))
    zero = integer(entry["zero"], f"{where}.zero", 0, 3)
    pp = integer(entry["pp"], f"{where}.pp", 1, world)
    if world % pp:
        raise RecordError(f"{where}.pp = {pp} does not divide the world of {world}")
    offload = entry.get("offload")
    if offload not in (None, "optimizer") or (offload and (zero < 2 or pp != 1)):
        raise RecordError(f"{where}.offload = {offload!r} is not an offload zeroc supports "
                          f"at zero={zero}, pp={pp}")
    options = fields(entry["options"], f"{where}.options", (), TUNABLE_OPTIONS)
    checked = {k: check_option(k, v) for k, v in options.items()}
    microbatches = checked.get("microbatches")
    if microbatches is not None and microbatches < pp:
        raise RecordError(f"{where}.options.microbatches = {microbatches} is under pp={pp}")
    return Candidate(zero, pp, tuple(sorted(checked.items())), offload)


def _seconds(value: Any, where: str) -> float | None:
    return None if value is None else number(value, where, 0.0, _MAX_SECONDS)


def _check_trial(data: Any, world: int, where: str) -> dict[str, Any]:
    entry = fields(data, where, _TRIAL_FIELDS, ("parts", "screened_s"))
    candidate_from_record(entry["candidate"], world, f"{where}.candidate")
    for name in ("estimated_s", "measured_s", "screened_s"):
        entry[name] = _seconds(entry.get(name), f"{where}.{name}")
    if entry["peak_bytes"] is not None:
        number(entry["peak_bytes"], f"{where}.peak_bytes", 0.0, float(1 << 62))
    text(entry["rejected"], f"{where}.rejected", 1000)
    parts = fields(entry.get("parts", {}), f"{where}.parts", (),
                   ("compute_s", "exposed_communication_s", "optimizer_s", "bubble"))
    entry["parts"] = {k: number(v, f"{where}.parts.{k}", 0.0, _MAX_SECONDS)
                      for k, v in parts.items()}
    return entry


def read_cached(path: str, key: str, world: int, device: str) -> dict[str, Any] | None:
    """The tune result at ``path`` for model key ``key`` on ``world`` ranks of ``device``
    (``{"best": Candidate, "trials": [checked dicts]}``), or None (absent, or refused: logged)."""
    def check(data: Any) -> dict[str, Any]:
        entry = fields(data, "result", ("best", "trials"))
        best = candidate_from_record(entry["best"], world, "best")
        trials = entry["trials"]
        if not isinstance(trials, list) or len(trials) > 100_000:
            raise RecordError("trials is not a list of at most 100000 trials")
        return {"best": best, "trials": [_check_trial(t, world, f"trials[{i}]")
                                         for i, t in enumerate(trials)]}

    return read_record(path, "tune result", TUNE_FORMAT, result_key(key, world, device), check,
                       what="tune result", log=log, root=_root(path), action="tuning again")


def read_layout(path: str, key: dict[str, Any]
                ) -> tuple[Candidate, str, tuple[tuple[int, ...], ...]] | None:
    """``(winner, the result file it came from, the input shapes it was tuned for)`` of the
    ``.layout`` at ``path`` made for ``key`` (``layout_key``), or None (absent, or refused:
    logged)."""
    def check(data: Any) -> tuple[Candidate, str, tuple[tuple[int, ...], ...]]:
        entry = fields(data, "layout", ("best", "inputs", "source"))
        best = candidate_from_record(entry["best"], key["world"], "best")
        shapes = entry["inputs"]
        if not isinstance(shapes, list) or len(shapes) > 64 or not all(
                isinstance(s, list) and len(s) <= 16 for s in shapes):
            raise RecordError("inputs is not a list of at most 64 shapes")
        inputs = tuple(tuple(integer(d, "an input size", 0, 1 << 40) for d in s)
                       for s in shapes)
        return best, text(entry["source"], "source"), inputs

    return read_record(path, "tune layout", TUNE_FORMAT, key, check, what="tuned layout",
                       log=log, root=_root(path), action="not using it")


def write_cached(cache_dir: str | None, model: nn.Module, example_inputs: Any, world: int,
                 device: str, best: Candidate, trials: list[dict[str, Any]]) -> str:
    """Store the winner and the trial table (``cache_path``) and the winner alone with the
    input shapes (``layout_path``, for ``parallelize(layout="auto")``); return the first's
    path. Raises ``OptionError`` when the cache directory is another user's or others can
    write it."""
    root = resolve_cache_dir(cache_dir)
    path = cache_path(cache_dir, model_key(model, example_inputs), world, device)
    key = model_key(model, example_inputs)
    write_record(root, path, "tune result", TUNE_FORMAT, result_key(key, world, device),
                 {"best": best.to_json(), "trials": trials})
    write_record(root, layout_path(cache_dir, model, world, device), "tune layout",
                 TUNE_FORMAT, layout_key(model, world, device),
                 {"best": best.to_json(), "inputs": input_shapes(example_inputs),
                  "source": path})
    return path


def read_on_rank0(reader: Any, path: str, *args: Any) -> Any:
    """``reader(path, *args)`` on global rank 0, the same value on every rank.

    Every rank must act on one answer: with a cache directory per node (the default is in
    the home directory), ranks reading their own files would disagree (one tunes with
    collectives while another returns, or two layouts meet). Only rank 0 writes, so only
    rank 0 reads, and its answer is broadcast."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return reader(path, *args)
    found = [reader(path, *args) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)
    return found[0]


def _shapes_text(shapes: Any) -> str:
    return ", ".join("x".join(map(str, s)) or "scalar" for s in shapes) or "none"


def tuned_options_for(layout: Any, example_inputs: list[Any]) -> tuple[tuple[str, Any], ...]:
    """The tuned compile options of a ``parallelize(layout="auto")`` model's ``layout`` to
    apply to a graph whose inputs are ``example_inputs``: all of them (only
    ``TUNABLE_OPTIONS``) when the tensors the model was first compiled with have every shape
    the layout was tuned for (Dynamo passes a tensor given twice once), else none (one
    warning). The first compile decides for every later graph of the model."""
    if not getattr(layout, "tuned_from", ""):
        return ()
    verdict = vars(layout).get(_MATCHED_ATTR)
    if verdict is None:
        wanted = {tuple(s) for s in getattr(layout, "tuned_inputs", ())}
        called = [tuple(v.shape) for v in example_inputs
                  if isinstance(v, torch.Tensor) and not hasattr(v, "_zeroc_layout")]
        verdict = (wanted <= set(called), _shapes_text(called))
        vars(layout)[_MATCHED_ATTR] = verdict  # a frozen dataclass: set past __setattr__
        if not verdict[0]:
            log.warning("zeroc: the layout tuned in %s was tuned for inputs of shapes %s, and "
                        "this model is compiled with tensors of shapes %s: its compile "
                        "options are not applied (its zero and pp are); run zeroc.tune with "
                        "these inputs", layout.tuned_from,
                        _shapes_text(layout.tuned_inputs), verdict[1])
    tuned = getattr(layout, "tuned_options", ())
    return tuple((k, v) for k, v in tuned if k in TUNABLE_OPTIONS) if verdict[0] else ()


def layout_match(layout: Any) -> str:
    """What matched between a ``parallelize(layout="auto")`` model and its tuned layout, for
    the plan's first line ("" when the layout was not tuned)."""
    if not getattr(layout, "tuned_from", ""):
        return ""
    found = versions()
    text_ = (f"model structure, world {layout.world}, torch {found['torch']} and zeroc "
             f"{found['zeroc']} matched")
    verdict = vars(layout).get(_MATCHED_ATTR)
    shapes = _shapes_text(getattr(layout, "tuned_inputs", ()))
    if verdict is None:
        return f"{text_}; tuned for input shapes {shapes} (not compiled yet)"
    if verdict[0]:
        return f"{text_}; input shapes {shapes} matched"
    return (f"{text_}; input shapes differ (tuned {shapes}): the tuned compile options were "
            "not applied")


def tuned_layout(model: nn.Module, layout: str, cache_dir: str | None
                 ) -> tuple[int, int, tuple[tuple[str, Any], ...], str, tuple, str | None]:
    """``(zero, pp, options, source file, input shapes, offload)`` of the tuned layout for
    ``model`` here (``zeroc.parallelize(layout="auto")``): one made for this model structure,
    world, device and torch and zeroc versions."""
    if layout != "auto":
        raise OptionError(f"zeroc.parallelize: layout={layout!r} is not allowed; use "
                          "layout='auto' (the zeroc.tune result) or None (zero= and pp=)")
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = layout_path(cache_dir, model, world, device)
    found = read_on_rank0(read_layout, path, layout_key(model, world, device))
    if found is None:
        raise OptionError(
            f"zeroc.parallelize: layout='auto' but no tuned layout for this model on {world} "
            f"rank(s) of {device} in {os.path.dirname(path)} (or a refused one: see the log): "
            "run zeroc.tune(model, example_inputs) (or python -m zeroc tune) first, with the "
            "same cache_dir")
    best, source, inputs = found
    log.info("zeroc.parallelize: tuned layout %s from %s", best.label(), source)
    return best.zero, best.pp, best.options, source, inputs, best.offload
