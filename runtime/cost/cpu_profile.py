"""A quick measured profile of this CPU: ``calibrate_cpu`` and its cache, ``cpu_profile``.

The best fp32 matmul FLOP/s, the bandwidth of a large tensor copy and the launch floor (the
time per node of a generated graph of tiny aten ops), measured as ``zeroc.calibrate()``
measures them (``zeroc.runtime.cost.calibration``) in shorter slots, as a ``HardwareProfile``
whose links are taken as memory. ``zeroc.calibrate()`` keeps more (matmul FLOP/s by shape
class, collectives on the real process group).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import socket
import time

import torch

from zeroc.runtime.cost import calibration
from zeroc.runtime.cost.hardware import (
    DEFAULT_CACHE_DIR,
    HardwareProfile,
    cpu_model,
    device_memory_bytes,
)
from zeroc.runtime.errors import OptionError

__all__ = ["calibrate_cpu", "cpu_profile"]

log = logging.getLogger(__name__)


def _positive(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def calibrate_cpu(seconds: float = 5.0) -> HardwareProfile:
    """Measure this machine in about ``seconds``: the best fp32 matmul FLOP/s over the shapes
    ``zeroc.calibrate`` times, the bandwidth of a large tensor copy (bytes read plus written)
    and the time of one node of a generated graph of tiny aten ops (the launch floor). Links
    are taken as memory: both bandwidths are the copy bandwidth, both latencies the launch
    floor."""
    if not _positive(seconds):
        raise OptionError(f"calibrate_cpu: seconds = {seconds!r} must be a positive number")
    start, cpu = time.perf_counter(), torch.device("cpu")
    # zeroc.calibrate's measurements, in shorter slots: 6 matmul shapes in half the time.
    flops = max(calibration.measure_matmul(cpu, seconds / 12)["float32"].values())
    bandwidth = calibration.measure_memory_bandwidth(cpu, 0.35 * seconds, device_memory_bytes())
    launch = calibration.measure_launch_floor(cpu, 0.15 * seconds)
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
           "launch_floor": "fx-node",  # what the launch floor times (a graph's node)
           "matmuls": "calibration shapes"}  # which products the peak is the best of
    root = os.path.abspath(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(root, "hardware", f"cpu-{digest}.json")
    profile = calibration.read_cached(path, key, "CPU profile", log)
    if profile is None:
        profile = calibrate_cpu(seconds)
        calibration.write_cached(root, path, key, profile, "CPU profile", log)
    return profile
