"""Measuring a machine for ``zeroc.calibrate``, checking what it measured, and the profile cache.

``zeroc.calibrate`` (``compiler/tuning/calibrate.py``) drives this module; a measured profile is a
``HardwareProfile`` (``zeroc.runtime.cost.hardware``) with its optional tables set:

- ``matmul_flops[dtype][shape class]``: the mean best FLOP/s of a square and a skinny product
  of each class of ``SHAPE_CLASSES`` (small / medium / large by FLOPs), fp32 on CPU, bf16 and
  fp32 on CUDA (``measure_matmul``);
- ``collectives[kind]["<size>:intra"|"<size>:inter"]``: ``latency_s + nbytes / bytes_per_s``
  fitted by least squares (``fit_line``) on the times of a few message sizes
  (``time_collectives``); ``nbytes`` is the full buffer of a gather or reduce-scatter, the
  buffer of an all-reduce, the message of a send. On gloo a reduce-scatter is timed as zeroc
  runs it there: an ``all_to_all_single`` of the rank-major rows and the sum of the rows
  received (``zeroc.runtime.collectives``).

Every timed collective runs the same number of times on every rank of its group: the count
comes from the slowest rank's first call (one all-reduce), so no rank waits for a call another
rank never makes. ``read_cached`` / ``write_cached`` keep profiles as records of
``zeroc.runtime.cached_files`` (the user's own files in private directories, a format version,
a checksum): a file read must hold the same key and a profile whose every figure is finite and
in a plausible range (``check_cached_profile``); a bad one is logged and measured again.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zeroc.runtime.cached_files import number, read_record, store_record, text
from zeroc.runtime.cost.hardware import HardwareProfile, cpu_model
from zeroc.runtime.cost.profile_tables import is_finite_number

log = logging.getLogger(__name__)

FORMAT = 5  # of the files under <cache_dir>/calibration/; another one is measured again
# (5: gloo's reduce-scatter timed as zeroc runs it since, an all-to-all)
PROFILE_KIND = "hardware profile"  # the record kind of a stored profile (cached_files)
DEFAULT_SECONDS = 0.3  # per measurement: about 3 s on one CPU, 15 s on GPUs with 3 group sizes
MAX_REPS = 200
# (m, k, n) of a square and a skinny product per shape class (the class of 2*m*k*n FLOPs).
MATMUL_SHAPES: dict[str, dict[str, tuple[tuple[int, int, int], ...]]] = {
    "cpu": {"small": ((128, 128, 128), (8, 512, 1024)),
            "medium": ((512, 512, 512), (32, 2048, 2048)),
            "large": ((1792, 1792, 1792), (256, 4096, 5120))},
    "cuda": {"small": ((256, 256, 256), (16, 1024, 2048)),
             "medium": ((1024, 1024, 1024), (128, 4096, 4096)),
             "large": ((8192, 8192, 8192), (1024, 8192, 8192))},
}
MATMUL_DTYPES = {"cpu": ("float32",), "cuda": ("bfloat16", "float32")}
MESSAGE_BYTES = {"cpu": (32 << 10, 512 << 10, 4 << 20), "cuda": (64 << 10, 4 << 20, 64 << 20)}
MEASURED_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "p2p")


_FIGURE_RANGES = {
    "memory_bytes_per_s": (0.0, 1e15), "intra_node_bytes_per_s": (0.0, 1e15),
    "inter_node_bytes_per_s": (0.0, 1e15), "intra_node_latency_s": (0.0, 60.0),
    "inter_node_latency_s": (0.0, 60.0), "launch_floor_s": (0.0, 1.0),
    "memory_bytes": (0.0, float(1 << 53)), "devices_per_node": (0.0, 4096.0)}


def check_cached_profile(data: Any, require: Sequence[str] = ()) -> HardwareProfile:
    """The profile a cache file holds, when every field is known, every figure finite and in
    range (``_FIGURE_RANGES``; FLOP/s in (0, 1e18]) and every field of ``require`` present;
    raises ``ValueError`` naming the field otherwise."""
    missing = [k for k in require if not isinstance(data, Mapping) or k not in data]
    if missing:
        raise ValueError(f"its profile lacks {', '.join(missing)}")
    profile = HardwareProfile.from_dict(data)
    for key, (low, high) in _FIGURE_RANGES.items():
        number(getattr(profile, key), f"profile {key}", low, high, above=True)
    for key in ("name", "source", "collectives_note"):
        if getattr(profile, key) is not None:
            text(getattr(profile, key), f"profile {key}")
    for table in (profile.peak_flops, *(profile.matmul_flops or {}).values()):
        for name, value in table.items():
            number(value, f"profile FLOP/s of {name}", 0.0, 1e18, above=True)
    for kind, groups in (profile.collectives or {}).items():
        for group, fit in groups.items():
            where = f"profile collectives[{kind}][{group}]"
            number(fit["latency_s"], f"{where} latency_s", 0.0, 60.0)
            number(fit["bytes_per_s"], f"{where} bytes_per_s", 0.0, 1e15, above=True)
            text(fit["op"], f"{where} op")
    return profile


def read_cached(path: str, key: Mapping[str, Any], what: str, logger: logging.Logger,
                require: Sequence[str] = ()) -> HardwareProfile | None:
    """The profile stored in ``path`` for ``key``; ``None`` when there is none or it is refused
    (another user's or writable by others, corrupt, for another key, out of range or lacking
    a field of ``require``: logged on ``logger``). The cache root is the file's grandparent
    (``<root>/calibration/<name>.json``)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    return read_record(path, PROFILE_KIND, FORMAT, dict(key),
                       lambda data: check_cached_profile(data, require), what=what, log=logger,
                       root=root, action="measuring again", max_bytes=1 << 20)


def write_cached(root: str, path: str, key: Mapping[str, Any], profile: HardwareProfile,
                 what: str, logger: logging.Logger) -> None:
    """Store ``profile`` for ``key`` in ``path`` (``cached_files.store_record``: a failure is
    only logged)."""
    store_record(root, path, PROFILE_KIND, FORMAT, dict(key), profile.to_dict(), what, logger)


def machine_name(device: torch.device) -> str:
    """The CPU model, or the GPU's name as CUDA gives it."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_rate(run: Callable[[], object], work: float, seconds: float,
              device: torch.device) -> float:
    """Best ``work`` per second of ``run`` in about ``seconds``: a warm-up call, then batches
    (doubling while short) until the next would overrun; a warm-up longer than ``seconds``
    is the only measurement."""
    _sync(device)
    start = time.perf_counter()
    run()
    _sync(device)
    first = max(time.perf_counter() - start, 1e-9)
    if first >= seconds:
        return work / first
    end, calls, best = start + seconds, 1, 0.0
    while True:
        begin = time.perf_counter()
        for _ in range(calls):
            run()
        _sync(device)
        now = time.perf_counter()
        elapsed = max(now - begin, 1e-9)
        best = max(best, work * calls / elapsed)
        if elapsed < seconds / 8:
            calls, elapsed = calls * 2, elapsed * 2
        if now + elapsed > end:
            return best


def measure_matmul(device: torch.device, seconds: float) -> dict[str, dict[str, float]]:
    """``{dtype: {shape class: FLOP/s}}`` on ``device``: per class, the mean of the best rates
    of its shapes in ``MATMUL_SHAPES``, each measured in about ``seconds``. float32 runs as
    this process is set to run it (TF32 when allowed): the TF32 switches are left alone, as
    changing them mixes torch's old and new precision APIs (an error on torch >= 2.9)."""
    table: dict[str, dict[str, float]] = {}
    shapes = MATMUL_SHAPES[device.type]
    for name in MATMUL_DTYPES[device.type]:
        log.info("calibrating %s matmuls on %s: %d shapes in %d classes", name, device,
                 sum(map(len, shapes.values())), len(shapes))
        dtype = getattr(torch, name)
        rates: dict[str, list[float]] = {}
        for shape_class, products in shapes.items():
            for m, k, n in products:
                a = torch.randn(m, k, device=device, dtype=dtype)
                b = torch.randn(k, n, device=device, dtype=dtype)
                out = torch.empty(m, n, device=device, dtype=dtype)
                run = functools.partial(torch.mm, a, b, out=out)
                rates.setdefault(shape_class, []).append(
                    best_rate(run, 2.0 * m * k * n, seconds, device))
                del a, b, out, run
        table[name] = {c: sum(r) / len(r) for c, r in rates.items()}
    return table


def measure_memory_bandwidth(device: torch.device, seconds: float, total_bytes: int) -> float:
    """Bytes read plus written per second by a large copy on ``device``."""
    if device.type == "cuda":
        nbytes = min(1 << 30, total_bytes // 8)
    else:
        nbytes = min(256 << 20 if seconds >= 0.2 else 32 << 20, total_bytes // 16)
    log.info("calibrating memory bandwidth on %s: copies of %d MiB", device, nbytes >> 20)
    src = torch.ones(max(nbytes // 4, 1 << 18), device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page of both before timing
    return best_rate(functools.partial(dst.copy_, src), 2.0 * src.nbytes, seconds, device)


def node_floor_graph(device: torch.device) -> tuple[Callable[[], object], int]:
    """A call of a generated FX graph of tiny aten ops on ``device`` and its node count.

    zeroc runs its graphs as generated Python calling aten ops one by one (its aten path), so
    each op costs at least the Python call, the dispatcher, the output's allocation and, on a
    GPU, the kernel launch: timing this graph per node gives that floor, for ops of every
    kind (arithmetic, views, copies). A single ``torch.add(out=)`` would leave out the
    allocation and the graph's own Python."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def chain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        for _ in range(32):
            a = a * b + 1.0
            a = a.view(-1, 4).t().contiguous().view(-1)
        return a

    a, b = torch.ones(64, device=device), torch.ones(64, device=device)
    graph = make_fx(chain)(a, b)
    nodes = sum(1 for n in graph.graph.nodes if n.op == "call_function")
    return functools.partial(graph, a, b), nodes


def measure_launch_floor(device: torch.device, seconds: float) -> float:
    """Seconds per node of a graph of tiny aten ops on ``device`` (``node_floor_graph``)."""
    log.info("calibrating the launch floor on %s", device)
    run, nodes = node_floor_graph(device)
    return 1.0 / best_rate(run, float(nodes), seconds, device)


def message_bytes(device: torch.device, group_size: int) -> list[int]:
    """The buffer sizes the collectives are timed at: fp32 buffers that split evenly."""
    return [4 * max(group_size, n // 4 // group_size * group_size)
            for n in MESSAGE_BYTES[device.type]]


def collective_ops(group: dist.ProcessGroup, device: torch.device) -> dict[str, str]:
    """What each measured kind runs on ``group``: zeroc's own calls (``zeroc.runtime.zero_ops``;
    on gloo its reduce-scatter is an all-to-all and the sum of the rows received)."""
    from zeroc.runtime.collectives import reduce_scatter_runs_as_all_to_all
    from zeroc.runtime.torch_compat import all_gather_single, reduce_scatter_single

    as_all_to_all = reduce_scatter_runs_as_all_to_all(group.group_name, device)
    return {"all_gather": all_gather_single.__name__,
            "reduce_scatter": "all_to_all_single + zeroc::rows_sum_mean (zeroc's reduce-scatter "
                              "on gloo, whose reduce_scatter_tensor is an all-reduce)"
            if as_all_to_all else reduce_scatter_single.__name__,
            "all_reduce": "all_reduce",
            "p2p": "send/recv between group ranks 0 and 1 (half a round trip)"}


def _agreed_time(run: Callable[[], None], group: dist.ProcessGroup, device: torch.device,
                 seconds: float) -> float:
    """Seconds per call of ``run``, the same number of calls on every rank of ``group``."""
    run()  # warm-up: connections, communicators
    _sync(device)
    start = time.perf_counter()
    run()
    _sync(device)
    first = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MAX, group=group)
    slowest = max(float(first.item()), 1e-9)
    reps = int(max(1, min(MAX_REPS, seconds / slowest - 2)))
    start = time.perf_counter()
    for _ in range(reps):
        run()
    _sync(device)
    return (time.perf_counter() - start) / reps


def _runs(group: dist.ProcessGroup, device: torch.device, nbytes: int,
          as_all_to_all: bool) -> tuple[Callable[[], None], ...]:
    """One call of each of ``MEASURED_KINDS`` on an ``nbytes`` buffer."""
    from zeroc.runtime.collectives import chunk_sum_mean
    from zeroc.runtime.torch_compat import all_gather_single, reduce_scatter_single

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    peer = dist.get_global_rank(group, 1 - rank) if rank < 2 else None
    full = torch.zeros(nbytes // 4, device=device)  # zeros: sums stay finite
    chunk = torch.zeros(nbytes // 4 // size, device=device)
    inbox = torch.empty_like(full)

    def gather() -> None:
        all_gather_single(full, chunk, group=group)

    def reduce_scatter() -> None:
        if as_all_to_all:
            dist.all_to_all_single(inbox, full, group=group)
            chunk_sum_mean(inbox, size)
        else:
            reduce_scatter_single(chunk, full, group=group)

    def all_reduce() -> None:
        dist.all_reduce(full, group=group)

    def p2p() -> None:
        if rank == 0:
            dist.send(full, dst=peer, group=group)
            dist.recv(inbox, src=peer, group=group)
        elif rank == 1:
            dist.recv(inbox, src=peer, group=group)
            dist.send(full, dst=peer, group=group)

    return gather, reduce_scatter, all_reduce, p2p


def time_collectives(group: dist.ProcessGroup, device: torch.device,
                     seconds: float) -> dict[str, list[float]]:
    """Seconds of each of ``MEASURED_KINDS`` on ``group`` at each of ``message_bytes``, each
    point in about ``seconds``; ``"p2p"`` is one way (0.0 on ranks other than 0 and 1)."""
    as_all_to_all = "all_to_all" in collective_ops(group, device)["reduce_scatter"]
    times: dict[str, list[float]] = {kind: [] for kind in MEASURED_KINDS}
    for nbytes in message_bytes(device, dist.get_world_size(group)):
        runs = _runs(group, device, nbytes, as_all_to_all)
        for kind, run in zip(MEASURED_KINDS, runs, strict=True):
            seconds_per_call = _agreed_time(run, group, device, seconds)
            times[kind].append(seconds_per_call / 2 if kind == "p2p" else seconds_per_call)
        del runs
    return times


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(latency_s, bytes_per_s)`` of ``t = latency_s + nbytes / bytes_per_s`` fitted by least
    squares on ``(nbytes, t)`` points, each weighted by ``1 / t**2`` (relative errors: the
    small messages set the latency, the large ones the bandwidth). A negative latency is
    refitted as 0 (a line through the origin); times that do not grow with the bytes give the
    smallest time as latency and the largest message over the largest time as bandwidth."""
    if len(points) < 2 or any(not (is_finite_number(x) and is_finite_number(t) and x > 0 and t >= 0)
                              for x, t in points):
        raise ValueError(f"fit_line needs two or more (bytes > 0, seconds >= 0) points, got "
                         f"{list(points)!r}")
    rows = [(float(x), float(t), 1.0 / max(float(t), 1e-12) ** 2) for x, t in points]
    w, wx, wt = (sum(c for _, _, c in rows), sum(c * x for x, _, c in rows),
                 sum(c * t for _, t, c in rows))
    wxx, wxt = sum(c * x * x for x, _, c in rows), sum(c * x * t for x, t, c in rows)
    det = w * wxx - wx * wx
    slope = (w * wxt - wx * wt) / det if det > 0 else 0.0
    latency = (wt - slope * wx) / w
    if latency < 0:
        latency, slope = 0.0, wxt / wxx
    if slope <= 0:
        times = [t for _, t, _ in rows]
        return min(times), max(x for x, _, _ in rows) / max(max(times), 1e-12)
    return latency, 1.0 / slope
