"""``zeroc.calibrate()``: a measured ``HardwareProfile`` of the machine at hand, cached.

The measurements are ``zeroc.runtime.cost.calibration``'s: matmul FLOP/s by shape class, memory
bandwidth, the launch floor and, with ``torch.distributed`` initialized, the all-gather,
reduce-scatter, all-reduce and p2p fits of the world group and of every other group size
present (``groups=``), and, when every rank is on one CPU host, how much slower they compute
together than alone (``zeroc.runtime.cost.shared_cores``). Every rank takes the maximum over the
ranks of each time (one all-reduce), so every rank gets the same profile and plans the same
way. The profile is kept in ``<cache_dir>/calibration/<key>.json`` (see ``calibration_key``)
and reused; a corrupt or stale file is measured again.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import os
import re
import socket
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from zeroc.runtime.cost import calibration
from zeroc.runtime.cost.hardware import (
    DEFAULT_CACHE_DIR,
    HardwareProfile,
    device_memory_bytes,
    profile_for_device_name,
)
from zeroc.runtime.cost.shared_cores import measure_shared_slowdown
from zeroc.runtime.errors import OptionError
from zeroc.runtime.mesh import Mesh, group_device, resolve_group

__all__ = ["calibrate", "calibration_key", "calibration_path"]

log = logging.getLogger(__name__)

_REQUIRED = ("matmul_flops", "collectives_note")  # what a calibrated file's profile must have


def _check(cache_dir: Any, seconds: Any, force: Any) -> float:
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise OptionError(f"calibrate: cache_dir = {cache_dir!r} must be a path (str or "
                          "os.PathLike) or None for ~/.cache/zeroc")
    if not isinstance(force, bool):
        raise OptionError(f"calibrate: force = {force!r} must be True or False")
    if seconds is None:
        return calibration.DEFAULT_SECONDS
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            math.isfinite(seconds) and 0 < seconds <= 60):
        raise OptionError(f"calibrate: seconds = {seconds!r} must be a number in (0, 60], the "
                          f"time of each measurement, or None for {calibration.DEFAULT_SECONDS}")
    return float(seconds)


def calibration_key(device: torch.device, backend: str, world: int,
                    groups: list[str]) -> dict[str, Any]:
    """What a stored calibration must have been measured for to be reused here: the machine
    (CPU model or GPU name, device count), torch, backend, world, group labels, threads."""
    count = torch.cuda.device_count() if device.type == "cuda" else os.cpu_count() or 1
    return {"format": calibration.FORMAT, "machine": calibration.machine_name(device),
            "device": device.type, "devices": count, "torch": torch.__version__,
            "backend": backend, "world": world, "groups": sorted(groups),
            "threads": torch.get_num_threads()}


def _slug(text: str) -> str:
    text = re.sub(r"\((r|tm|c)\)", "", text.lower())
    return re.sub(r"[^a-z0-9.]+", "-", text).strip("-") or "unknown"


def calibration_path(cache_dir: str | os.PathLike[str] | None,
                     key: dict[str, Any]) -> tuple[str, str]:
    """``(root, <root>/calibration/<key>.json)``; ``cache_dir`` defaults to ~/.cache/zeroc.
    The name is readable (machine, devices, torch, backend, world, groups) plus a digest of
    the whole key."""
    root = os.path.abspath(os.path.expanduser(os.fspath(cache_dir or DEFAULT_CACHE_DIR)))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    groups = "-".join(g.replace(":", "") for g in key["groups"]) or "none"
    name = (f"{_slug(key['machine'])[:60]}-x{key['devices']}-torch{_slug(key['torch'])}-"
            f"{_slug(key['backend'])}-w{key['world']}-g{groups[:60]}-{digest}")
    return root, os.path.join(root, "calibration", f"{name}.json")


def _candidates(groups: Any) -> list[dist.ProcessGroup]:
    """The world group and ``groups`` (process groups, group names, ``Mesh``es or ``None``)."""
    if groups is not None and (isinstance(groups, (str, Mesh)) or not isinstance(groups, Iterable)):
        groups = [groups]
    found = [dist.group.WORLD]
    for index, item in enumerate(groups or ()):
        items = [item.dp_group(), item.pp_group()] if isinstance(item, Mesh) else [item]
        for group in items:
            group = resolve_group(group) if isinstance(group, str) else group
            if group is None:
                continue  # a degree of 1: nothing to measure
            if not isinstance(group, dist.ProcessGroup):
                raise OptionError(f"calibrate: groups[{index}] = {item!r} is not allowed: give "
                                  "process groups, their names or a zeroc Mesh")
            if dist.get_rank(group) < 0:
                raise OptionError(f"calibrate: groups[{index}] (ranks "
                                  f"{dist.get_process_group_ranks(group)}) does not hold rank "
                                  f"{dist.get_rank()}; give each rank its own groups")
            found.append(group)
    return found


def _choose_groups(groups: Any) -> tuple[dict[str, dist.ProcessGroup], list[str]]:
    """One group per ``"<size>:intra"`` / ``"<size>:inter"`` label (the first given), checked
    to be the same labels on every rank, and the host name of every rank."""
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    chosen: dict[str, dist.ProcessGroup] = {}
    problem = None
    try:  # a bad group is reported on every rank: none is left waiting in a collective
        for group in _candidates(groups):
            ranks = dist.get_process_group_ranks(group)
            if len(ranks) > 1:
                link = "inter" if len({hosts[r] for r in ranks}) > 1 else "intra"
                chosen.setdefault(f"{len(ranks)}:{link}", group)
    except OptionError as exc:
        problem = str(exc)
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, (sorted(chosen), problem))
    for rank, (_, error) in enumerate(found):
        if error is not None:
            raise OptionError(error if rank == dist.get_rank() else f"rank {rank}: {error}")
    labels = [names for names, _ in found]
    if any(names != labels[0] for names in labels):
        raise OptionError(f"calibrate: the ranks gave groups of different sizes (by rank: "
                          f"{labels}); give every rank its groups in the same order")
    return {label: chosen[label] for label in sorted(chosen)}, hosts


def _agree(table: dict[str, dict[str, float]], bandwidth: float, launch: float,
           times: dict[str, dict[str, list[float]]], device: torch.device) -> tuple[Any, ...]:
    """The slowest rank's figures of everything measured, by one all-reduce."""
    values = [1.0 / r for classes in table.values() for r in classes.values()]
    values += [1.0 / bandwidth, launch]
    values += [t for kinds in times.values() for points in kinds.values() for t in points]
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    slowest = iter(tensor.tolist())
    table = {d: {c: 1.0 / next(slowest) for c in classes} for d, classes in table.items()}
    bandwidth, launch = 1.0 / next(slowest), next(slowest)
    times = {g: {k: [next(slowest) for _ in points] for k, points in kinds.items()}
             for g, kinds in times.items()}
    return table, bandwidth, launch, times


def _fits(times: dict[str, dict[str, list[float]]], chosen: dict[str, dist.ProcessGroup],
          device: torch.device) -> dict[str, dict[str, dict[str, Any]]]:
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for label, kinds in times.items():
        group = chosen[label]
        sizes = calibration.message_bytes(device, dist.get_world_size(group))
        ops = calibration.collective_ops(group, device)
        for kind, points in kinds.items():
            latency, bandwidth = calibration.fit_line(list(zip(sizes, points, strict=True)))
            fit = {"latency_s": latency, "bytes_per_s": bandwidth, "op": ops[kind]}
            for name in ("send", "recv") if kind == "p2p" else (kind,):
                table.setdefault(name, {})[label] = dict(fit)
    return table


def _links(fits: dict[str, dict[str, dict[str, Any]]] | None, device: torch.device,
           bandwidth: float, launch: float) -> tuple[tuple[float, float, float, float], str]:
    """(intra bytes/s, intra latency, inter bytes/s, inter latency) and where they come from:
    the ring-model link of the largest measured all-gather of each kind of link."""
    links: dict[str, tuple[float, float]] = {}
    for label, fit in sorted((fits or {}).get("all_gather", {}).items(),
                             key=lambda item: int(item[0].split(":")[0])):
        size, link = int(label.split(":")[0]), label.split(":")[1]
        links[link] = (fit["bytes_per_s"] * (size - 1) / size,
                       max(fit["latency_s"] / (size - 1), 1e-9))
    if links:
        intra = links.get("intra", links.get("inter"))
        inter = links.get("inter", intra)
        return (*intra, *inter), "links: the ring model of the measured all-gathers"
    known = profile_for_device_name(calibration.machine_name(device)) if (
        device.type == "cuda") else None
    if known is not None:
        return (known.intra_node_bytes_per_s, known.intra_node_latency_s,
                known.inter_node_bytes_per_s, known.inter_node_latency_s), \
            f"links: not measured, those of {known.name}"
    return (bandwidth, launch, bandwidth, launch), \
        "links: not measured, taken as memory (copy bandwidth, launch floor)"


def calibrate(cache_dir: str | os.PathLike[str] | None = None, groups: Any = None,
              seconds: float | None = None, force: bool = False) -> HardwareProfile:
    """Measure this machine (see the module) and return its profile, usable wherever a
    ``hardware=`` profile is (``zeroc.explain(..., hardware=profile)``).

    ``cache_dir``: where ``calibration/<key>.json`` is kept (default ``~/.cache/zeroc``); a
    file for the same machine (CPU model or GPU name, device count), torch version, backend,
    world and group sizes and thread count is reused unless ``force``. ``groups``: process
    groups (or their names, or a zeroc ``Mesh``) besides the world whose sizes to measure,
    given in the same order on every rank; collective, like the whole call when
    ``torch.distributed`` is initialized (rank 0's file and ``force`` decide for all).
    ``seconds``: the time of each measurement (default ``DEFAULT_SECONDS``; the whole call
    then takes a few seconds on one CPU, under 60 s on GPUs). Bad arguments raise
    ``OptionError`` (a ``ValueError``)."""
    budget = _check(cache_dir, seconds, force)
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        backend = str(dist.get_backend())
        device = group_device()
        chosen, hosts = _choose_groups(groups)
        per_node, world = max(collections.Counter(hosts).values()), dist.get_world_size()
    else:
        if groups:
            raise OptionError(f"calibrate: groups = {groups!r} needs torch.distributed "
                              "initialized; without it, give groups=None")
        backend, world, chosen = "none", 1, {}
        device = torch.device("cuda", torch.cuda.current_device()) if (
            torch.cuda.is_available()) else torch.device("cpu")
        per_node = torch.cuda.device_count() if device.type == "cuda" else 1
    key = calibration_key(device, backend, world, list(chosen))
    root, path = calibration_path(cache_dir, key)
    cached = None
    if not force and (not distributed or dist.get_rank() == 0):
        cached = calibration.read_cached(path, key, "calibration", log, require=_REQUIRED)
    if distributed:
        box = [cached.to_dict() if cached is not None else None]
        dist.broadcast_object_list(box, src=0, device=device)
        cached = HardwareProfile.from_dict(box[0]) if box[0] is not None else None
    if cached is not None:
        log.info("using the calibration of %s in %s", cached.name, path)
        return cached
    start = time.perf_counter()
    log.info("calibrating %s (%s, world %d) in about %.2f s per measurement",
             calibration.machine_name(device), backend, world, budget)
    total = device_memory_bytes(device)
    table = calibration.measure_matmul(device, budget)
    bandwidth = calibration.measure_memory_bandwidth(device, budget, total)
    launch = calibration.measure_launch_floor(device, budget)
    times = {}
    for label, group in chosen.items():
        log.info("calibrating collectives on group %s (size:link) with %s", label, backend)
        times[label] = calibration.time_collectives(group, device, budget)
    shared = None
    if distributed:
        table, bandwidth, launch, times = _agree(table, bandwidth, launch, times, device)
        if device.type == "cpu" and world > 1 and len(set(hosts)) == 1:
            log.info("calibrating how much slower %d ranks compute together than alone", world)
            shared = {str(world): measure_shared_slowdown(dist.group.WORLD, budget)}
    fits = _fits(times, chosen, device) if chosen else None
    if fits:
        note = (f"measured with {backend} on groups {', '.join(chosen)} of a {world}-rank "
                "world, the slowest rank's times; reduce_scatter: "
                f"{fits['reduce_scatter'][next(iter(chosen))]['op']}")
    elif distributed:
        note = "not measured: the world has 1 rank"
    else:
        note = "not measured: torch.distributed is not initialized"
    (intra, intra_lat, inter, inter_lat), links = _links(fits, device, bandwidth, launch)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    prefix = "cpu-" if device.type == "cpu" else ""
    profile = HardwareProfile(
        name=f"{prefix}{_slug(key['machine'])}-measured",
        peak_flops={d: max(classes.values()) for d, classes in table.items()},
        memory_bytes_per_s=bandwidth, memory_bytes=total,
        intra_node_bytes_per_s=intra, intra_node_latency_s=intra_lat,
        inter_node_bytes_per_s=inter, inter_node_latency_s=inter_lat,
        devices_per_node=per_node, launch_floor_s=launch,
        source=f"measured by zeroc.calibrate on {socket.gethostname()} {when}: "
               f"{key['machine']} x{key['devices']}, torch {torch.__version__}, backend "
               f"{backend}, world {world}, {torch.get_num_threads()} threads; {links}",
        matmul_flops=table, collectives=fits, collectives_note=note, shared_slowdown=shared)
    calibration.write_cached(root, path, key, profile, "calibration", log)
    log.info("calibrated %s in %.1f s, stored in %s", profile.name,
             time.perf_counter() - start, path)
    return profile
