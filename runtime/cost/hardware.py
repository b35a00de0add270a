"""Hardware profiles: what a device can do, as data, and a measured profile of this CPU.

A ``HardwareProfile`` holds the figures a cost estimate needs (peak dense FLOP/s by dtype,
memory, links inside and between nodes, launch floor). The known devices are in
``hardware_profiles.json`` beside this module; ``get_profile`` also takes a user's dict.
``zeroc.runtime.cost.cpu_profile`` measures this machine; ``zeroc.calibrate`` adds
optional tables (matmul FLOP/s by shape class, collective fits). ``estimate_compute_s`` is a
roofline, ``estimate_collective_s`` a measured fit or the ring model. Sizes are decimal (a
datasheet's "80GB" is 80e9 bytes, under the 80 GiB the device reports); links per direction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.resources
import json
import logging
import os
import platform
import re
from collections.abc import Mapping
from typing import Any

import torch

from zeroc.runtime.cost.profile_tables import (  # noqa: F401 (re-exported)
    COLLECTIVE_KINDS,
    FLOPS_DTYPES,
    SHAPE_CLASSES,
    check_tables,
    is_finite_number,
)
from zeroc.runtime.cost.shared_cores import check_shared_slowdown
from zeroc.runtime.errors import OptionError

log = logging.getLogger(__name__)

# Sources of hardware_profiles.json (each profile's "source" field names its own). FLOP/s are
# dense, without 2:4 structured sparsity (datasheets print both; the sparse one is twice);
# NVLink figures count both directions, the profiles hold one (half).
# - NVIDIA A100 Tensor Core GPU datasheet, "A100 80GB SXM": FP32 19.5 TFLOPS, TF32 156,
#   BF16/FP16 312; HBM2e 80GB at 2,039 GB/s; NVLink 600 GB/s.
#   https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
# - NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM" (exact dense figures from the H100
#   architecture whitepaper): FP32 66.9 TFLOPS, TF32 494.7, BF16/FP16 989.4; HBM3 80GB at
#   3.35 TB/s; NVLink 900 GB/s. https://www.nvidia.com/en-us/data-center/h100/
# - NVIDIA H200 Tensor Core GPU datasheet, "H200 SXM": the compute of the H100 SXM; HBM3e
#   141GB at 4.8 TB/s; NVLink 900 GB/s. https://www.nvidia.com/en-us/data-center/h200/
# - Between nodes, one NIC per GPU as in NVIDIA DGX systems: ConnectX-7, 400 Gb/s NDR
#   InfiniBand (50 GB/s) in DGX H100/H200; ConnectX-6, 200 Gb/s HDR (25 GB/s) in DGX A100.
# - Latencies (about 3 us in a node, 5 us between nodes) and the 5 us launch floor are
#   typical measured values, not datasheet figures.

DEFAULT_CACHE_DIR = "~/.cache/zeroc"
_CPU = torch.device("cpu")
_DATA = "hardware_profiles.json"
# Dtype names a profile may give FLOP/s for ("tf32": float32 matmuls on TF32 tensor cores).
_DTYPE_ALIASES = {"fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32",
                  "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
# Matmul shape classes by the FLOPs of one product: small < 1e8 <= medium < 1e10 <= large.
SHAPE_CLASS_BOUNDS = (1e8, 1e10)
_FLOAT_FIELDS = ("memory_bytes_per_s", "intra_node_bytes_per_s", "intra_node_latency_s",
                 "inter_node_bytes_per_s", "inter_node_latency_s", "launch_floor_s")
_INT_FIELDS = ("memory_bytes", "devices_per_node")
_OPTIONAL_FIELDS = ("matmul_flops", "collectives", "collectives_note", "shared_slowdown")
_LINKS = {False: "intra", True: "inter"}  # the link part of a collectives key
_PROFILES: dict[str, HardwareProfile] = {}  # filled from hardware_profiles.json below


def dtype_name(dtype: torch.dtype | str) -> str:
    """The name ``peak_flops`` uses for ``dtype``: ``torch.bfloat16``, ``"bf16"`` and
    ``"torch.bfloat16"`` are all ``"bfloat16"``; ``"tf32"`` stays ``"tf32"``."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    name = dtype.strip().lower().removeprefix("torch.") if isinstance(dtype, str) else ""
    name = _DTYPE_ALIASES.get(name, name)
    if name == "tf32" or isinstance(getattr(torch, name, None), torch.dtype):
        return name
    raise OptionError(f"unknown dtype {dtype!r}; expected a torch.dtype or one of "
                      f"{', '.join(FLOPS_DTYPES)}")


def shape_class(flops: float) -> str:
    """The ``SHAPE_CLASSES`` entry of a matmul of ``flops`` FLOPs (see ``SHAPE_CLASS_BOUNDS``)."""
    return SHAPE_CLASSES[sum(flops >= bound for bound in SHAPE_CLASS_BOUNDS)]


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """The figures of one kind of device. Bandwidths are bytes/s per direction;
    ``inter_node_bytes_per_s`` is what one device gets to other nodes. ``peak_flops`` must give
    ``"float32"``. Every field is checked: a bad one raises ``OptionError`` (a ``ValueError``).
    The last three, optional, are a measured profile's (``zeroc.runtime.cost.calibration``)."""

    name: str
    peak_flops: dict[str, float]
    memory_bytes_per_s: float
    memory_bytes: int
    intra_node_bytes_per_s: float
    intra_node_latency_s: float
    inter_node_bytes_per_s: float
    inter_node_latency_s: float
    devices_per_node: int
    launch_floor_s: float
    source: str
    matmul_flops: dict[str, dict[str, float]] | None = None
    collectives: dict[str, dict[str, dict[str, Any]]] | None = None
    collectives_note: str | None = None
    # A CPU's: how much slower a rank computes with N ranks busy on its host ({"N": factor}).
    shared_slowdown: dict[str, float] | None = None

    def __post_init__(self) -> None:
        where = f"hardware profile {self.name!r}: key"
        for key in ("name", "source"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key).strip():
                raise OptionError(f"{where} {key!r} = {getattr(self, key)!r} must be a "
                                  "non-empty string")
        peaks = self.peak_flops
        if not isinstance(peaks, Mapping) or "float32" not in peaks:
            raise OptionError(f"{where} 'peak_flops' = {peaks!r} must be a dict of FLOP/s by "
                              f"dtype that gives 'float32'; dtypes: {', '.join(FLOPS_DTYPES)}")
        for dtype, value in peaks.items():
            if dtype not in FLOPS_DTYPES or not is_finite_number(value) or value <= 0:
                raise OptionError(f"{where} 'peak_flops[{dtype!r}]' = {value!r}: the dtype must "
                                  f"be one of {', '.join(FLOPS_DTYPES)} and the FLOP/s > 0")
        object.__setattr__(self, "peak_flops", {k: float(v) for k, v in peaks.items()})
        for key in _FLOAT_FIELDS + _INT_FIELDS:
            value, integer = getattr(self, key), key in _INT_FIELDS
            if not is_finite_number(value) or value <= 0 or (integer and int(value) != value):
                kind = "integer" if integer else "number"
                raise OptionError(f"{where} {key!r} = {value!r} must be a positive {kind}")
            object.__setattr__(self, key, int(value) if integer else float(value))
        if (self.matmul_flops, self.collectives, self.collectives_note) != (None, None, None):
            check_tables(self)
        object.__setattr__(self, "shared_slowdown", check_shared_slowdown(
            f"hardware profile {self.name!r}: key", self.shared_slowdown))

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.peak_flops.items())), self.source))

    def flops_for(self, dtype: torch.dtype | str) -> float:
        """Peak dense FLOP/s for ``dtype``; a dtype without a figure of its own (integers,
        float64 on most profiles) gets the ``"float32"`` one. ``torch.float32`` means full
        fp32: ask for ``"tf32"`` when TF32 matmuls are allowed."""
        return self.peak_flops.get(dtype_name(dtype), self.peak_flops["float32"])

    def matmul_flops_for(self, dtype: torch.dtype | str, flops: float) -> float:
        """Measured FLOP/s of a ``flops``-FLOP matmul (its shape class), else ``flops_for``."""
        table = (self.matmul_flops or {}).get(dtype_name(dtype), {})
        return table.get(shape_class(flops)) or self.flops_for(dtype)

    def to_dict(self) -> dict[str, Any]:
        """The profile as plain JSON values (optional ones if set); ``from_dict`` inverts it."""
        data = {k: v for k, v in dataclasses.asdict(self).items()
                if v is not None or k not in _OPTIONAL_FIELDS}
        data["peak_flops"] = dict(self.peak_flops)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HardwareProfile:
        """A profile from a dict of exactly its fields; an unknown or missing key or a bad
        value raises ``OptionError`` (a ``ValueError``) naming the key and what is allowed."""
        fields = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, Mapping):
            raise OptionError(f"a hardware profile must be a dict with keys {', '.join(fields)}; "
                              f"got {type(data).__name__}")
        for key in data:
            if key not in fields:
                raise OptionError(f"hardware profile: unknown key {key!r} = {data[key]!r}; "
                                  f"allowed keys: {', '.join(fields)}")
        missing = [k for k in fields if k not in data and k not in _OPTIONAL_FIELDS]
        if missing:
            raise OptionError(f"hardware profile: missing key(s) {', '.join(missing)}; give all "
                              f"of {', '.join(fields)}, or 'base': one of {', '.join(_PROFILES)} "
                              "and only the keys to change")
        return cls(**{k: data[k] for k in fields if k in data})


def _load_known() -> tuple[dict[str, HardwareProfile], tuple[tuple[re.Pattern[str], str], ...]]:
    package = __name__.rpartition(".")[0]
    data = json.loads(importlib.resources.files(package).joinpath(_DATA).read_text("utf-8"))
    profiles = {entry["name"]: HardwareProfile.from_dict(entry) for entry in data["profiles"]}
    if len(profiles) != len(data["profiles"]) or any(n != n.lower() for n in profiles):
        raise ValueError(f"{_DATA}: profile names must be distinct and lower case")
    patterns = tuple((re.compile(pattern), name) for pattern, name in data["device_names"])
    if any(name not in profiles for _, name in patterns):
        raise ValueError(f"{_DATA}: a device name maps to an unknown profile")
    return profiles, patterns


_PROFILES, _DEVICE_PATTERNS = _load_known()
KNOWN_PROFILES: tuple[str, ...] = tuple(_PROFILES)


def _known(name: str) -> HardwareProfile:
    profile = _PROFILES.get(name.strip().lower()) if isinstance(name, str) else None
    if profile is None:
        raise OptionError(f"unknown hardware {name!r}; known: {', '.join(KNOWN_PROFILES)} "
                          "(or give a dict of HardwareProfile fields)")
    return profile


def get_profile(hardware: str | Mapping[str, Any] | HardwareProfile) -> HardwareProfile:
    """The profile ``hardware`` stands for: a name of ``KNOWN_PROFILES`` (any case); a dict of
    every ``HardwareProfile`` field; a dict with ``"base": <known name>`` and only the fields
    to change (``peak_flops`` entries are merged into the base's, ``name`` defaults to
    ``<base>-custom``); or a profile, as is. A bad name, key or value raises ``OptionError``
    (a ``ValueError``), anything else ``TypeError``."""
    if isinstance(hardware, HardwareProfile):
        return hardware
    if isinstance(hardware, str):
        return _known(hardware)
    if not isinstance(hardware, Mapping):
        raise TypeError(f"hardware must be a profile name, a dict or a HardwareProfile, got "
                        f"{type(hardware).__name__}")
    data = dict(hardware)
    if "base" not in data:
        return HardwareProfile.from_dict(data)
    base = _known(data.pop("base"))
    if not data:
        return base
    merged = base.to_dict()
    if isinstance(data.get("peak_flops"), Mapping):
        data["peak_flops"] = {**merged["peak_flops"], **data["peak_flops"]}
    merged["name"] = f"{base.name}-custom"
    merged["source"] = f"{base.source}; changed by the user: {', '.join(sorted(data))}"
    merged.update(data)
    return HardwareProfile.from_dict(merged)


def profile_for_device_name(device_name: str) -> HardwareProfile | None:
    """The known profile of a device named as ``torch.cuda.get_device_name()`` names it
    (``"NVIDIA H200"`` -> ``h200``), or ``None`` when none fits (e.g. PCIe boards, whose
    figures differ from the SXM ones)."""
    found = (_PROFILES[n] for pattern, n in _DEVICE_PATTERNS if pattern.search(device_name.lower()))
    return next(found, None)


def cpu_model() -> str:
    """This machine's CPU model, as the OS names it."""
    with contextlib.suppress(OSError):  # no /proc: fall back to what platform knows
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                    return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def device_memory_bytes(device: torch.device = _CPU) -> int:
    """The memory of ``device``: a CUDA device's total memory, else this machine's RAM."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    with contextlib.suppress(OSError, ValueError, IndexError, StopIteration):  # no /proc
        with open("/proc/meminfo", encoding="utf-8") as handle:
            return next(int(ln.split()[1]) * 1024 for ln in handle if ln.startswith("MemTotal:"))
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError) as exc:
        raise RuntimeError("cannot read this machine's memory size") from exc


def estimate_compute_s(flops: float, bytes_moved: float, dtype: torch.dtype | str,
                       profile: str | Mapping[str, Any] | HardwareProfile) -> float:
    """Roofline time of one op: ``max(flops / peak(dtype), bytes_moved / memory bandwidth,
    launch floor)``; the peak is ``matmul_flops_for`` (the shape class's when measured)."""
    hardware = get_profile(profile)
    for key, value in (("flops", flops), ("bytes_moved", bytes_moved)):
        if not is_finite_number(value) or value < 0:
            raise OptionError(f"estimate_compute_s: {key} = {value!r} must be a number >= 0")
    return max(flops / hardware.matmul_flops_for(dtype, flops),
               bytes_moved / hardware.memory_bytes_per_s, hardware.launch_floor_s)


def estimate_collective_s(kind: str, nbytes: int, group_size: int,
                          profile: str | Mapping[str, Any] | HardwareProfile,
                          inter_node: bool) -> float:
    """Ring-model time of a collective over ``group_size`` devices, on the links between
    nodes when ``inter_node``, else on those inside a node. ``all_gather`` / ``reduce_scatter``
    of a buffer of ``nbytes`` (the full, gathered size): ``(g-1)/g * nbytes / bandwidth +
    (g-1) * latency``; ``all_reduce``: twice that; ``send`` / ``recv``: ``nbytes / bandwidth +
    latency``. A group of one takes 0 s. A fit in ``collectives[kind]["<size>:intra"|inter]``
    gives ``latency_s + nbytes / bytes_per_s``."""
    if kind not in COLLECTIVE_KINDS:
        raise OptionError(f"unknown collective kind {kind!r}; allowed: "
                          f"{', '.join(COLLECTIVE_KINDS)}")
    if (not is_finite_number(nbytes) or nbytes < 0 or not isinstance(group_size, int)
            or group_size < 1):
        raise OptionError(f"estimate_collective_s: nbytes = {nbytes!r} must be a number >= 0 "
                          f"and group_size = {group_size!r} an int >= 1")
    hardware = get_profile(profile)
    if group_size == 1:
        return 0.0
    fit = (hardware.collectives or {}).get(kind, {}).get(f"{group_size}:{_LINKS[inter_node]}")
    if fit is not None:
        return fit["latency_s"] + nbytes / fit["bytes_per_s"]
    if inter_node:
        bandwidth, latency = hardware.inter_node_bytes_per_s, hardware.inter_node_latency_s
    else:
        bandwidth, latency = hardware.intra_node_bytes_per_s, hardware.intra_node_latency_s
    if kind in ("send", "recv"):
        return nbytes / bandwidth + latency
    ring = (group_size - 1) / group_size * nbytes / bandwidth + (group_size - 1) * latency
    return 2.0 * ring if kind == "all_reduce" else ring
