"""How much slower a rank computes when the other ranks of its host compute at the same time.

On a CPU the ranks of one host share its cores, caches, memory bandwidth and (on a virtual
machine) whatever the hypervisor gives them. An op timed alone on an idle host runs faster
than the same op inside a job whose every rank is busy: on a 2-core virtual machine, two
processes of one thread each ran a small GPT's forward and backward 1.1-1.2x slower than one
alone. ``measure_shared_slowdown`` finds that factor on the job's own ranks: each rank of the
group in turn times a fixed compute mix (a matmul, GELU, a layer norm and a softmax) while
the others wait in a barrier, then all time it together; the factor is the slowest rank's
time together over its time alone. ``zeroc.calibrate()`` stores it in the profile
(``shared_slowdown``, keyed by the number of ranks on the host), and the step estimate for
this machine scales every op it timed alone by it (``zeroc.runtime.cost.op_timing``).

The same sharing is why a CPU rank's collectives do not hide behind its compute: gloo
copies and reduces on the cores the ranks compute on, so where the ranks' threads fill the
cores (``no_spare_cores``) the estimate runs communication in line with compute.

GPU ranks do not share their device, so nothing is measured on GPUs.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from zeroc.runtime.errors import OptionError
from zeroc.runtime.mesh import group_device

__all__ = ["check_shared_slowdown", "measure_shared_slowdown", "no_spare_cores",
           "slowdown_for"]

# The compute mix's widths: tensors of 256 KiB (within a core's own cache) and of 1 MiB (past
# it, as a transformer block's activations are). Sharing slows the second kind most: on a
# 2-core virtual machine two ranks ran the 256-wide mix as fast as one, the 512-wide one
# 1.4-1.5x slower, and a small GPT's forward and backward 1.1-1.2x slower.
_WIDTHS = (256, 512)


def _compute_mix() -> Any:
    """One run of the fixed mix of ops a transformer's graphs are made of."""
    generator = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(w, w, generator=generator), torch.randn(w, w, generator=generator),
              torch.ones(w)) for w in _WIDTHS]

    def run() -> None:
        for a, b, weight in pairs:
            x = torch.mm(a, b)
            x = torch.nn.functional.gelu(x)
            x = torch.nn.functional.layer_norm(x, (a.shape[1],), weight)
            torch.softmax(x, dim=-1)

    return run


def _median_seconds(run: Any, seconds: float) -> float:
    """Median seconds of one ``run()`` over batches filling about ``seconds``. The median, not
    ``calibration.best_rate``'s best batch: sharing slows the ranks on average, and the best
    batch together is one the others happened to leave alone (two ranks here: 1.0x by the
    best batch, 1.09-1.17x by the median)."""
    run()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds / 10 or calls < 3:
        run()
        calls += 1
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 50):
        begin = time.perf_counter()
        for _ in range(calls):
            run()
        times.append((time.perf_counter() - begin) / calls)
    return statistics.median(times)


def measure_shared_slowdown(group: dist.ProcessGroup, seconds: float) -> float:
    """The slowest rank's (time with every rank of ``group`` computing) / (time alone), at
    least 1. Collective: every rank of ``group`` calls it, and gets the same factor."""
    run = _compute_mix()
    with torch.no_grad():
        alone = 0.0
        me = dist.get_rank(group)
        for turn in range(dist.get_world_size(group)):
            dist.barrier(group=group)  # the others wait here, off the cores, while one times
            if turn == me:
                alone = _median_seconds(run, seconds)
        dist.barrier(group=group)
        together = _median_seconds(run, seconds)
    factor = torch.tensor([together / alone], dtype=torch.float64, device=group_device())
    dist.all_reduce(factor, op=dist.ReduceOp.MAX, group=group)
    return max(1.0, float(factor))


def check_shared_slowdown(where: str, value: Any) -> dict[str, float] | None:
    """``value`` as ``{ranks on the host (a string): factor >= 1}``; raises ``OptionError``
    naming the key otherwise."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and k.isdigit() and int(k) >= 1
            and isinstance(v, (int, float)) and not isinstance(v, bool) and 1 <= v < 1e3
            for k, v in value.items()):
        raise OptionError(f"{where} 'shared_slowdown' = {value!r} must be a dict of "
                          "{'<ranks on a host>': factor >= 1}, e.g. {'2': 1.4}, or absent")
    return {k: float(v) for k, v in value.items()}


def slowdown_for(profile: Any, ranks: int, threads: int) -> float:
    """How much slower each of ``ranks`` ranks of ``threads`` threads on this host computes
    than one alone: the profile's measured factor for that many ranks, else the share of
    the cores when their threads outnumber them (else 1)."""
    measured = (getattr(profile, "shared_slowdown", None) or {}).get(str(ranks))
    if measured is not None and ranks > 1:
        return measured
    return max(1.0, ranks * threads / (os.cpu_count() or 1))


def no_spare_cores(ranks: int, threads: int) -> bool:
    """Whether ``ranks`` ranks of ``threads`` threads leave no core of this host idle (then
    their collectives run on cores that would otherwise compute)."""
    return ranks > 1 and ranks * threads >= (os.cpu_count() or 1)
