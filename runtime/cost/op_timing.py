"""Measured times of a graph's own ops on the machine at hand, for the step estimate.

A roofline (FLOPs at the matmul peak, bytes at the copy bandwidth, at least the launch floor)
misses most of what an op costs on a CPU: small matmuls run well below the peak, attention
and transcendental pointwise ops (GELU, exp) are compute-bound far under it, and every view
is a Python call through the dispatcher. When the plan is for this machine, the estimate
times each op itself instead: ``encode_call`` records a node's call (its ``OpOverload``, the
shapes, strides and dtypes of its tensor arguments and its other arguments as plain values)
in the plan's ``NodeCost.call`` (while planning); ``OpTimes.seconds`` rebuilds the call on
real tensors (random floats, zero integers: valid indices and targets for every op that reads
them), runs it a few times and keeps the median, once per distinct call. Results persist under
``<cache_dir>/op_times/``, keyed by CPU model, core count, torch version, thread count and
the timing method, so a second plan of the same shapes measures nothing (each call on the
host clock; on a CUDA device, its device time between two events). The table is a record of
``zeroc.runtime.cached_files``: one with a time that is not a finite number of seconds in
[0, 3600], another user's file or a corrupt one is ignored with a log line and measured
again. Between two timed calls 1 MiB is written: in a graph other ops run between two calls
of one op, so its inputs are not all in the core's own cache (timed back to back, matmuls
and small pointwise ops ran up to 5x faster than inside the graph; with 8 MiB written they
ran up to 2x slower).
Each timed call's output is held (up to 64 MiB), as a training graph holds what its ops
write: the allocator hands every call memory it has not just freed. Reusing the freed block
timed a 256x128x384 addmm at 0.19 ms and a GELU over 4x64x512 at 0.09 ms where the same calls
took 0.46-0.55 and 0.14-0.25 ms inside a pipeline stage's forward; held, 0.36 and 0.30.

zeroc's fused kernels are timed too: each names itself by a ``timing_key`` (a hash of its
code), which this process resolves while the kernel lives. A call that cannot be rebuilt
(another callable, an argument that is not a tensor or a plain value, an op that raises on
the rebuilt inputs) has no time, and the estimate keeps its roofline for that node.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import sys
import time
import weakref
from typing import Any

import torch

from zeroc.runtime.cached_files import RecordError, number, read_record, store_record
from zeroc.runtime.cost.hardware import DEFAULT_CACHE_DIR, cpu_model
from zeroc.runtime.cost.shared_cores import no_spare_cores, slowdown_for
from zeroc.runtime.step_clock import RegionTimer
from zeroc.runtime.torch_compat import OpOverload, tree_leaves, unset_fake_temporarily

__all__ = ["OpTimes", "encode_call", "op_times_for"]

log = logging.getLogger(__name__)

# Timing stops after this many calls or this much time per op, whichever comes first.
_MAX_CALLS = 15
_MAX_SECONDS = 0.02
# Written between two timed calls, so an op's inputs are not left in the core's own caches
# by its previous run (in a graph other ops ran in between).
_FLUSH_BYTES = 1 << 20
# How ops are timed, in the cache key: a table timed another way is not reused.
_METHOD = "median-of-15, 1 MiB written between calls, outputs held"
# The persisted table: its record kind and format, the longest time an entry may hold, the
# longest encoded call and the largest file read back.
_KIND, _FORMAT = "op times", 1
_MAX_OP_SECONDS = 3600.0
_MAX_CALL_CHARS = 1 << 16
_MAX_TABLE_BYTES = 256 << 20
# Outputs held across timed calls, at most: a training graph keeps what its ops write (saved
# activations, gradients), so each op writes memory the allocator has just handed out.
_KEPT_BYTES = 64 << 20
# Ops that communicate (their time is the collectives model's), and zeroc's own ops but the
# ones that only compute.
_SKIPPED_NAMESPACES = ("_c10d_functional", "c10d", "zeroc")
_COMPUTE_ONLY = {"zeroc.linear_cross_entropy"}
_PLAIN = (bool, int, float, str, type(None))
# Callables timed by key (``timing_key``), while they live: a key whose callable is gone
# cannot be rebuilt, and keeps its roofline unless the persisted table has its time.
_TIMED_CALLABLES: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def _concrete(value: Any) -> int:
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        hint = value.node.hint
        return int(hint) if hint is not None else 0
    return int(value)


def _encode(value: Any) -> Any:
    """A JSON value for one argument; raises ValueError for one that cannot be rebuilt.
    Tensors, dtypes, devices and enums become dicts of ``$``-keys, which no keyword argument
    can be named, so ``_decode`` tells them from a dict of keyword arguments."""
    if isinstance(value, torch.Tensor):
        return {"$t": [_concrete(s) for s in value.shape],
                "$s": [_concrete(s) for s in value.stride()], "$d": str(value.dtype)[6:]}
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        return _concrete(value)
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value)[6:]}
    if isinstance(value, torch.device):
        return {"$device": True}
    if isinstance(value, (torch.layout, torch.memory_format)):
        return {"$enum": str(value)[6:]}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, _PLAIN):
        if isinstance(value, float) and value != value:
            raise ValueError("nan argument")
        return value
    raise ValueError(f"argument of type {type(value).__name__}")


def encode_call(target: Any, args: tuple, kwargs: dict) -> str:
    """The call of ``target`` on ``args`` / ``kwargs`` (values: tensors, fake or real, and
    plain values) as a JSON string; ``""`` when it cannot be rebuilt. ``target`` is an aten
    ``OpOverload`` or a callable with a ``timing_key`` (zeroc's fused kernels: the key names
    its code), which this process remembers while the callable lives."""
    key = getattr(target, "timing_key", None)
    if isinstance(key, str):
        _TIMED_CALLABLES[key] = target
        name = key
    elif not isinstance(target, OpOverload):
        return ""
    elif target.namespace in _SKIPPED_NAMESPACES \
            and f"{target.namespace}.{target._opname}" not in _COMPUTE_ONLY:
        return ""
    else:
        name = f"{target.namespace}.{target._opname}.{target._overloadname}"
    try:
        return json.dumps({"op": name,
                           "args": _encode(list(args)), "kwargs": _encode(dict(kwargs))},
                          sort_keys=True, separators=(",", ":"))
    except ValueError:
        return ""


def _decode(value: Any, device: torch.device) -> Any:
    if isinstance(value, list):
        return [_decode(v, device) for v in value]
    if not isinstance(value, dict):
        return value
    if "$t" in value:
        dtype = getattr(torch, value["$d"])
        span = 1 + sum((size - 1) * stride for size, stride in zip(value["$t"], value["$s"],
                                                                   strict=True) if size > 0)
        if dtype.is_floating_point or dtype.is_complex:
            storage = torch.randn(span, dtype=dtype, device=device)
        else:
            storage = torch.zeros(span, dtype=dtype, device=device)
        return storage.as_strided(value["$t"], value["$s"])
    if "$dtype" in value:
        return getattr(torch, value["$dtype"])
    if "$device" in value:
        return device
    if "$enum" in value:
        return getattr(torch, value["$enum"])
    return {k: _decode(v, device) for k, v in value.items()}


def _resolve(name: str) -> Any:
    known = _TIMED_CALLABLES.get(name)
    if known is not None:
        return known
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _time_call(call: str, device: torch.device) -> float | None:
    """Median seconds of one run of ``call`` on rebuilt inputs; None when it cannot run."""
    spec = json.loads(call)
    try:
        target = _resolve(spec["op"])
        with unset_fake_temporarily():
            args = _decode(spec["args"], device)
            kwargs = _decode(spec["kwargs"], device)
        with torch.no_grad(), unset_fake_temporarily():
            target(*args, **kwargs)  # warm-up (and the check that it runs at all)
            flush = torch.empty(_FLUSH_BYTES // 4, device=device)
            timer = RegionTimer(device)  # on CUDA: the device's time of each call (events)
            calls = 0
            kept: list[Any] = []  # outputs held, so each call writes memory not yet touched
            kept_bytes = 0
            deadline = time.perf_counter() + _MAX_SECONDS
            while calls < _MAX_CALLS and (calls < 3 or time.perf_counter() < deadline):
                flush.zero_()  # in a graph an op's inputs were written by others, not by it
                with timer.region():
                    out = target(*args, **kwargs)
                calls += 1
                kept.append(out)
                kept_bytes += sum(t.untyped_storage().nbytes() for t in tree_leaves(out)
                                  if isinstance(t, torch.Tensor))
                if kept_bytes > _KEPT_BYTES:
                    kept, kept_bytes = [], 0
            times = timer.seconds()
    except Exception as error:  # an op that needs real values, or arguments we cannot rebuild
        log.debug("op timing: %s did not run on rebuilt inputs (%s)", spec["op"], error)
        return None
    return statistics.median(times)


def _time_adamw(numels: list[int], dtensor: bool) -> float | None:
    """Median seconds of ``torch.optim.AdamW.step`` (its default implementation here) over
    fp32 parameters of ``numels`` elements, DTensors sharded on a 2-rank mesh when
    ``dtensor`` (a parallelized model's parameters): their per-op dispatch is most of a small
    model's optimizer step. None when a DTensor mesh cannot be made (a process group is
    already initialized in this process)."""
    import torch.distributed as dist

    made_group = False
    try:
        with unset_fake_temporarily():
            params = [torch.randn(n) for n in numels]
            grads = [torch.randn(n) for n in numels]
            if dtensor:
                if dist.is_initialized():
                    return None
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.tensor import DTensor, Shard

                from zeroc.runtime.torch_compat import FakeStore

                hook = sys.excepthook  # torch wraps it with a rank prefix: not this process's
                dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
                sys.excepthook = hook
                made_group = True
                mesh = init_device_mesh("cpu", (2,))
                params, grads = ([DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
                                  for t in tensors] for tensors in (params, grads))
            params = [torch.nn.Parameter(p) for p in params]
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad
            optimizer = torch.optim.AdamW(params, lr=1e-3)
            times = []
            for _ in range(4):
                start = time.perf_counter()
                optimizer.step()
                times.append(time.perf_counter() - start)
        return statistics.median(times[1:])
    except Exception as error:
        log.debug("op timing: AdamW on %d tensors did not run (%s)", len(numels), error)
        return None
    finally:
        if made_group:
            dist.destroy_process_group()


def _check_table(data: Any) -> dict[str, float | None]:
    """A persisted table: encoded calls to seconds in [0, ``_MAX_OP_SECONDS``] or None (a call
    that cannot run); raises ``RecordError`` naming the first bad entry."""
    if not isinstance(data, dict):
        raise RecordError(f"the table is a {type(data).__name__}, not a dict")
    for call, seconds in data.items():
        if len(call) > _MAX_CALL_CHARS:
            raise RecordError(f"a call of {len(call)} characters is longer than "
                              f"{_MAX_CALL_CHARS}")
        if seconds is not None:
            data[call] = number(seconds, f"the time of {call[:80]}", 0.0, _MAX_OP_SECONDS)
    return data


class OpTimes:
    """Measured seconds per encoded call on this machine's CPU (see the module docstring)."""

    def __init__(self, cache_dir: str | None = None, ranks_per_machine: int = 1,
                 profile: Any = None) -> None:
        self.device = torch.device("cpu")
        # Ops are timed alone: in the job every rank of the host computes at once, each this
        # much slower (measured by the profile's calibration, else the ranks' share of cores).
        threads = torch.get_num_threads()
        self.scale = slowdown_for(profile, ranks_per_machine, threads)
        # Collectives run on the cores the ranks compute on: none is hidden behind compute.
        self.inline_communication = no_spare_cores(ranks_per_machine, threads)
        key = {"cpu_model": cpu_model(), "cores": os.cpu_count() or 1,
               "torch": torch.__version__, "threads": threads, "method": _METHOD}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        root = os.path.abspath(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR))
        self.root, self.path = root, os.path.join(root, "op_times", f"ops-{digest}.json")
        self.key = key
        self.times: dict[str, float | None] = self._read()
        self.measured = 0

    def _read(self) -> dict[str, float | None]:
        return read_record(self.path, _KIND, _FORMAT, self.key, _check_table,
                           what="op timing table", log=log, root=self.root,
                           max_bytes=_MAX_TABLE_BYTES) or {}

    def seconds(self, call: str) -> float | None:
        """Seconds of one run of ``call`` by one of the job's ranks (measured alone once, then
        remembered, times ``self.scale``, the host's shared slowdown); None when it has no
        measurable form."""
        if not call:
            return None
        if call not in self.times:
            self.times[call] = _time_call(call, self.device)
            self.measured += 1
        seconds = self.times[call]
        return None if seconds is None else seconds * self.scale

    def optimizer_seconds(self, numels: list[int], dtensor: bool) -> float | None:
        """Seconds of one AdamW step over parameters of ``numels`` elements (DTensors when
        ``dtensor``), measured once per distinct set, scaled as ``seconds``."""
        if not numels:
            return 0.0
        key = json.dumps({"op": "adamw", "numels": sorted(numels), "dtensor": dtensor},
                         sort_keys=True, separators=(",", ":"))
        if key not in self.times:
            self.times[key] = _time_adamw(numels, dtensor)
            self.measured += 1
        seconds = self.times[key]
        return None if seconds is None else seconds * self.scale

    def save(self) -> None:
        """Persist the table (private directories, through a temporary file); a failure is
        only logged."""
        if not self.measured:
            return
        store_record(self.root, self.path, _KIND, _FORMAT, self.key, self.times,
                     "op timing table", log)
        log.debug("op timing: measured %d calls (%d known) for %s", self.measured,
                  len(self.times), self.path)
        self.measured = 0


def op_times_for(profile: Any, device: str, world: int,
                 cache_dir: str | None = None) -> OpTimes | None:
    """An ``OpTimes`` when the plan is for this machine's CPU (``device="cpu"`` and a profile
    measured here); None otherwise (another machine's ops cannot be timed here)."""
    import socket

    if device != "cpu" or not profile.name.startswith("cpu") \
            or f" on {socket.gethostname()} " not in f"{profile.source} ":
        return None
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    ranks = min(world, int(local)) if local.isdigit() and int(local) > 0 else world
    return OpTimes(cache_dir, ranks_per_machine=ranks, profile=profile)
