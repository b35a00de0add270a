"""Run a command's ranks where the user runs it: under ``torchrun``, or as N local processes.

The demo (``python -m zeroc demo``) and the tuner (``python -m zeroc tune``) share this:

- :func:`in_torchrun` says whether a launcher set ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``;
  :func:`run_torchrun` then initializes the process group from the environment (``env://``)
  with the device's backend and calls ``fn(rank, world, *args)`` in this process.
- :func:`run_local_ranks` starts ``nproc`` ranks on this machine through
  ``zeroc.cli._rank_processes`` (torch's own ``torch.multiprocessing.start_processes``, from a
  forkserver that has already imported torch, spawn where there is none; the tests' launcher
  ``zeroc.cli.launch`` shares it) and a ``TCPStore`` the parent owns (so no port can be taken
  between picking and using it); ``nproc == 1`` runs ``fn(0, 1, *args)`` in this process
  with no process group.

:func:`resolve_device` turns ``auto``/``cpu``/``cuda`` into the device the ranks use. On CPU the
backend is gloo and every started rank runs one thread (``OMP_NUM_THREADS=1``); on CUDA it is
NCCL and rank ``r`` uses GPU ``LOCAL_RANK`` (``torch.cuda.set_device``, and
``init_process_group(device_id=...)``, which binds the group to that GPU).

Ctrl-C ends every rank with one line and exit code 130: the parent stops its ranks (SIGINT,
then SIGTERM, then SIGKILL, each after a grace period) and prints ``<name>: interrupted;
stopped N ranks``; a rank that is interrupted exits 130 without a traceback (ranks ignore
SIGINT while they start, so an interrupt during their imports cannot print one either). A
rank that fails stops the others and gives one line naming the rank, its exception
and a file holding its traceback, and exit code 1.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zeroc.cli._rank_processes import (
    INTERRUPTED,
    Ranks,
    backend_for,
    how_it_ended,
    init_group,
    sigint_ignored,
    start_ranks,
)

__all__ = ["DEVICES", "backend_for", "in_torchrun", "init_from_torchrun", "resolve_device",
           "run_local_ranks", "run_torchrun"]

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def in_torchrun() -> bool:
    """Whether a launcher (``torchrun``, ``torch.distributed.run``) started this process as one
    rank of a world: ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` are all set."""
    return all(name in os.environ for name in _TORCHRUN_VARIABLES)


def resolve_device(device: str | None, ranks_here: int = 1) -> str:
    """``"cpu"`` or ``"cuda"`` for ``device`` (one of :data:`DEVICES`; ``None`` means ``auto``)
    when ``ranks_here`` ranks run on this machine, one GPU each on CUDA.

    ``auto`` is CUDA when this machine has a GPU for every local rank, else CPU. ``cuda``
    without a GPU, or with fewer GPUs than ranks, raises ``ValueError`` saying what is allowed.
    """
    device = "auto" if device is None else device
    if device not in DEVICES:
        raise ValueError(f"--device {device!r} is not allowed; choose one of {list(DEVICES)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        return "cuda" if gpus >= max(ranks_here, 1) else "cpu"
    if device == "cuda" and gpus == 0:
        built = torch.version.cuda is not None or getattr(torch.version, "hip", None)
        build = "found no GPU" if built else "built without CUDA"
        raise ValueError(f"--device cuda: no CUDA GPU is available here (torch "
                         f"{torch.__version__} {build}); use --device cpu or --device auto")
    if device == "cuda" and gpus < ranks_here:
        raise ValueError(f"--device cuda with {ranks_here} ranks on this machine needs a GPU "
                         f"per rank, but it has {gpus}; use at most {gpus} ranks or --device cpu")
    return device


def init_from_torchrun(device: str | None) -> tuple[int, int]:
    """Initialize the default process group from torchrun's environment; ``(rank, world)``.

    ``device`` as for :func:`resolve_device` (``auto`` counts ``LOCAL_WORLD_SIZE`` ranks on
    this machine); on CUDA this rank uses GPU ``LOCAL_RANK`` and the NCCL group is bound to it
    (``device_id``). An already initialized group is used as it is.
    """
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    device = resolve_device(device, local_world)
    local_rank = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        init_group(device, local_rank)  # env://; NCCL bound to GPU LOCAL_RANK (device_id)
    return dist.get_rank(), dist.get_world_size()


def run_torchrun(fn: Callable[..., Any], *args: Any, device: str | None = None,
                 name: str = "zeroc") -> int:
    """Call ``fn(rank, world, *args)`` on the world torchrun started; the exit code.

    The process group is initialized from the environment (see :func:`init_from_torchrun`) and
    destroyed afterwards if this call initialized it. Ctrl-C returns 130, rank 0 printing
    ``<name>: interrupted``; an exception propagates, for torchrun to report.
    """
    owned = not dist.is_initialized()
    rank = int(os.environ.get("RANK", "0"))
    try:
        rank, world = init_from_torchrun(device)
        code = fn(rank, world, *args)
    except KeyboardInterrupt:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: no traceback
        if rank == 0:
            print(f"{name}: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()
    return code if isinstance(code, int) else 0


def run_local_ranks(fn: Callable[..., Any], nproc: int, *args: Any, device: str | None = None,
                    name: str = "zeroc") -> int:
    """Run ``fn(rank, nproc, *args)`` on ``nproc`` ranks of this machine; the exit code.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). ``device`` as for
    :func:`resolve_device`. ``nproc == 1`` calls ``fn`` in this process without a process
    group. Otherwise each rank joins a ``backend_for(device)`` group of ``nproc``; an
    ``int`` ``fn`` returns other than 0 is that rank's exit code. 0 when every rank succeeded,
    130 after Ctrl-C, 1 (or the rank's code) when a rank failed; ``name`` starts the one line
    printed then.
    """
    if nproc < 1:
        raise ValueError(f"--nproc {nproc} is not allowed: start at least 1 rank")
    device = resolve_device(device, nproc)
    try:
        if nproc == 1:
            if device == "cuda":
                torch.cuda.set_device(0)
            code = fn(0, 1, *args)
            return code if isinstance(code, int) else 0
        ranks = start_ranks(fn, nproc, args, device=device, command=True)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED
    with ranks:
        try:
            if ranks.interrupted:  # Ctrl-C while the ranks started
                return _interrupted(ranks, name)
            return _wait(ranks, name)
        except KeyboardInterrupt:
            return _interrupted(ranks, name)


def _wait(ranks: Ranks, name: str) -> int:
    """Wait for every rank; on the first that fails, stop the others and report it."""
    while events := ranks.wait():
        for event in events:
            if event.kind == "raised":
                ranks.stop()
                _report(name, _failure(event.rank, event.value))
                return 1
            code = event.value if isinstance(event.value, int) else 0
            if code == 0 or isinstance(event.value, bool):
                continue  # a result of 0 (or not a code), or a clean exit
            if event.kind == "exited" and code in (INTERRUPTED, -signal.SIGINT):
                return _interrupted(ranks, name)  # Ctrl-C reached the ranks
            ranks.stop()
            _report(name, f"rank {event.rank} {how_it_ended(code)}")
            return code if code > 0 else 1
    return 0


def _interrupted(ranks: Ranks, name: str) -> int:
    """Ctrl-C: stop every rank (SIGINT first), print one line; 130."""
    with sigint_ignored():
        ranks.stop(signal.SIGINT)
    print(f"{name}: interrupted; stopped {ranks.world} ranks", file=sys.stderr, flush=True)
    return INTERRUPTED


def _report(name: str, what: str) -> None:
    print(f"{name}: {what}; stopped the other ranks", file=sys.stderr, flush=True)


def _failure(rank: int, trace: str) -> str:
    """``rank R failed: Error: message (traceback in FILE)``."""
    log.debug("rank %d failed:\n%s", rank, trace)
    lines = [line for line in trace.strip().splitlines() if line.strip()]
    fd, path = tempfile.mkstemp(prefix=f"zeroc-rank{rank}-", suffix=".txt")
    with os.fdopen(fd, "w") as handle:
        handle.write(trace)
    return f"rank {rank} failed: {lines[-1] if lines else 'an exception'} (traceback in {path})"
