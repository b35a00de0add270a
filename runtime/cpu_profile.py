"""A quick measured profile of this CPU: ``calibrate_cpu`` and its cache, ``cpu_profile``.

The best fp32 matmul FLOP/s over a few square sizes, the bandwidth of a large tensor copy and
the launch floor (the time per node of a generated graph of tiny aten ops), in a few seconds,
as a ``HardwareProfile`` whose links are taken as memory. ``zeroc.calibrate()`` measures more
(matmul FLOP/s by shape class, collectives on the real process group); this is the profile a
plan for this CPU gets without it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import re
import socket
import time
from collections.abc import Callable

import torch

from zeroc.runtime.errors import OptionError
from zeroc.runtime.hardware import (
    DEFAULT_CACHE_DIR,
    HardwareProfile,
    cpu_model,
    device_memory_bytes,
)

__all__ = ["calibrate_cpu", "cpu_profile"]

log = logging.getLogger(__name__)


def _positive(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def _best_rate(run: Callable[[], object], work: float, end: float, min_batch_s: float) -> float:
    """Best ``work`` per second of ``run`` over batches of at least ``min_batch_s`` (doubling
    the batch until it is that long), started while the next batch should end by ``end``."""
    best = fallback = 0.0
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            run()
        now = time.perf_counter()
        elapsed = max(now - start, 1e-9)
        if elapsed >= min_batch_s:
            best = max(best, work * calls / elapsed)
        else:
            fallback = max(fallback, work * calls / elapsed)
            calls, elapsed = calls * 2, elapsed * 2
        if now + elapsed > end:
            return best or fallback


def _matmul_flops(end: float) -> float:
    best, sizes = 0.0, (256, 512, 1024, 2048)
    for index, n in enumerate(sizes):
        if best and 3 * 2.0 * n**3 / best > end - time.perf_counter():
            break  # three products of this size would not fit the time left
        a, b, out = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        torch.mm(a, b, out=out)  # warm-up: thread pool, packing buffers
        slot = (end - time.perf_counter()) / (len(sizes) - index)
        run = functools.partial(torch.mm, a, b, out=out)
        stop = time.perf_counter() + slot
        best = max(best, _best_rate(run, 2.0 * n**3, stop, min(0.02, slot / 4)))
    return best


def _copy_bandwidth(end: float) -> float:
    budget = max(end - time.perf_counter(), 0.0)
    nbytes = min(256 << 20 if budget >= 0.2 else 64 << 20, device_memory_bytes() // 16)
    src = torch.ones(max(nbytes // 4, 1 << 18))
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page of both before timing
    run = functools.partial(dst.copy_, src)
    return _best_rate(run, 2.0 * src.nbytes, end, min(0.02, budget / 8))


def _launch_floor(end: float) -> float:
    from zeroc.runtime.calibration import node_floor_graph  # it imports this module
    run, nodes = node_floor_graph(torch.device("cpu"))
    run()
    budget = max(end - time.perf_counter(), 0.0)
    return 1.0 / _best_rate(run, float(nodes), end, min(0.01, budget / 8 + 1e-4))


def calibrate_cpu(seconds: float = 5.0) -> HardwareProfile:
    """Measure this machine in about ``seconds``: the best fp32 matmul FLOP/s over a few
    square sizes, the bandwidth of a large tensor copy (bytes read plus written) and the time
    of one node of a generated graph of tiny aten ops (the launch floor). Links are taken as
    memory: both bandwidths are the copy bandwidth, both latencies the launch floor."""
    if not _positive(seconds):
        raise OptionError(f"calibrate_cpu: seconds = {seconds!r} must be a positive number")
    start = time.perf_counter()
    flops = _matmul_flops(start + 0.5 * seconds)
    bandwidth = _copy_bandwidth(start + 0.85 * seconds)
    launch = _launch_floor(start + seconds)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    slug = re.sub(r"[^a-z0-9]+", "-", re.sub(r"\((r|tm|c)\)", "", cpu_model().lower())).strip("-")
    profile = HardwareProfile(
        name=f"cpu-{slug or 'unknown'}", peak_flops={"float32": flops},
        memory_bytes_per_s=bandwidth, memory_bytes=device_memory_bytes(),
        intra_node_bytes_per_s=bandwidth, intra_node_latency_s=launch,
        inter_node_bytes_per_s=bandwidth, inter_node_latency_s=launch,
        devices_per_node=1, launch_floor_s=launch,
        source=f"measured on {socket.gethostname()} {when}, torch {torch.__version__}, "
               f"{torch.get_num_threads()} threads")
    log.info("calibrated %s in %.2f s: %.3g FLOP/s fp32, %.3g B/s, launch %.3g s", profile.name,
             time.perf_counter() - start, flops, bandwidth, launch)
    return profile


def cpu_profile(cache_dir: str | None = None, seconds: float = 5.0) -> HardwareProfile:
    """This machine's measured profile: read from ``<cache_dir>/hardware/`` when it was
    measured for the same CPU model, core count, torch version and ``torch.get_num_threads()``,
    else ``calibrate_cpu(seconds)`` and stored there (``cache_dir`` defaults to
    ``~/.cache/zeroc``, created with mode 0o700). A corrupt or stale file is measured again
    and a cache that cannot be written is only logged."""
    key = {"cpu_model": cpu_model(), "cores": os.cpu_count() or 1,
           "torch": torch.__version__, "threads": torch.get_num_threads(),
           "launch_floor": "fx-node"}  # what the launch floor times (a graph's node)
    root = os.path.abspath(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(root, "hardware", f"cpu-{digest}.json")
    from zeroc.runtime.calibration import read_cached, write_cached  # it imports this module
    profile = read_cached(path, key, "CPU profile", log)
    if profile is None:
        profile = calibrate_cpu(seconds)
        write_cached(root, path, key, profile, "CPU profile", log)
    return profile
