"""Run a command's ranks where the user runs it: under ``torchrun``, or as N local processes.

The demo (``python -m zeroc demo``) and the tuner (``python -m zeroc tune``) share this:

- :func:`in_torchrun` says whether a launcher set ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``;
  :func:`run_torchrun` then initializes the process group from the environment (``env://``)
  with the device's backend and calls ``fn(rank, world, *args)`` in this process.
- :func:`run_local_ranks` starts ``nproc`` ranks on this machine with torch's own
  ``torch.multiprocessing.start_processes`` (spawn) and a ``TCPStore`` the parent owns (so no
  port can be taken between picking and using it); ``nproc == 1`` runs ``fn(0, 1, *args)`` in
  this process with no process group.

:func:`resolve_device` turns ``auto``/``cpu``/``cuda`` into the device the ranks use. On CPU the
backend is gloo and every spawned rank runs one thread (``OMP_NUM_THREADS=1``); on CUDA it is
NCCL and rank ``r`` uses GPU ``LOCAL_RANK`` (``torch.cuda.set_device``).

Ctrl-C ends every rank with one line and exit code 130: the parent stops its ranks (SIGINT,
then SIGTERM, then SIGKILL, each after a grace period) and prints ``<name>: interrupted;
stopped N ranks``; a rank that is interrupted exits 130 without a traceback (ranks ignore
SIGINT while Python starts them, so an interrupt during their imports cannot print one
either). A rank that fails stops the others and gives one line naming the rank, its exception
and a file holding its traceback, and exit code 1.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DEVICES", "backend_for", "in_torchrun", "init_from_torchrun", "resolve_device",
           "run_local_ranks", "run_torchrun"]

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")
INTERRUPTED = 130  # the shell's exit code for a process ended by SIGINT
_HOST = "127.0.0.1"
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_INTERRUPT_GRACE_S = 3.0
_TERMINATE_GRACE_S = 5.0


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


def backend_for(device: str) -> str:
    """The process-group backend for ``device``: ``nccl`` on ``cuda``, ``gloo`` on ``cpu``."""
    return "nccl" if device == "cuda" else "gloo"


def init_from_torchrun(device: str | None) -> tuple[int, int]:
    """Initialize the default process group from torchrun's environment; ``(rank, world)``.

    ``device`` as for :func:`resolve_device` (``auto`` counts ``LOCAL_WORLD_SIZE`` ranks on
    this machine); on CUDA this rank uses GPU ``LOCAL_RANK``. An already initialized group is
    used as it is.
    """
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    device = resolve_device(device, local_world)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device))
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
    group. Otherwise each spawned rank joins a ``backend_for(device)`` group of ``nproc``; an
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
        store = dist.TCPStore(_HOST, 0, None, is_master=True, wait_for_workers=False)
        with _starting_ranks(device):
            context = torch.multiprocessing.start_processes(
                _rank_entry, args=(fn, nproc, store.port, device, os.getpid(), args),
                nprocs=nproc, join=False, start_method="spawn")
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED
    try:
        return _wait(context, name)
    except KeyboardInterrupt:
        with _sigint_ignored():
            _stop(context.processes, interrupt=True)
        print(f"{name}: interrupted; stopped {nproc} ranks", file=sys.stderr, flush=True)
        return INTERRUPTED
    finally:
        _remove_error_files(context.error_files)


def _rank_entry(rank: int, fn: Callable[..., Any], world: int, port: int, device: str,
                parent: int, args: tuple) -> None:
    """One spawned rank: SIGINT handling, threads or GPU, the process group, then ``fn``."""
    signal.signal(signal.SIGINT, _interrupt_once)
    code = 0
    try:
        if os.getppid() != parent:  # the parent ended while this rank was starting
            raise KeyboardInterrupt
        if device == "cuda":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)
        store = dist.TCPStore(_HOST, port, world, is_master=False)
        dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world)
        try:
            code = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except KeyboardInterrupt:
        raise SystemExit(INTERRUPTED) from None
    if isinstance(code, int) and code != 0:
        raise SystemExit(code)


def _interrupt_once(signum: int, frame: Any) -> None:
    """SIGINT in a rank: raise ``KeyboardInterrupt`` once, ignore any further SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT in this process (main thread only) for the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _starting_ranks(device: str) -> Iterator[None]:
    """While ranks are spawned: they inherit SIGINT ignored (their own handler is installed in
    :func:`_rank_entry`) and, on CPU, ``OMP_NUM_THREADS=1``."""
    saved = os.environ.get("OMP_NUM_THREADS")
    if device == "cpu":
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        with _sigint_ignored():
            yield
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def _wait(context: Any, name: str) -> int:
    """Wait for every rank; on the first that fails, stop the others and report it."""
    sentinels = {process.sentinel: rank for rank, process in enumerate(context.processes)}
    while sentinels:
        for sentinel in multiprocessing.connection.wait(list(sentinels)):
            rank = sentinels.pop(sentinel)
            process = context.processes[rank]
            process.join()
            if process.exitcode == 0:
                continue
            if process.exitcode in (INTERRUPTED, -signal.SIGINT):  # Ctrl-C reached the ranks
                with _sigint_ignored():
                    _stop(context.processes, interrupt=True)
                print(f"{name}: interrupted; stopped {len(context.processes)} ranks",
                      file=sys.stderr, flush=True)
                return INTERRUPTED
            _stop(context.processes, interrupt=False)
            print(f"{name}: {_failure(rank, process.exitcode, context.error_files[rank])}; "
                  "stopped the other ranks", file=sys.stderr, flush=True)
            return process.exitcode if process.exitcode > 0 else 1
    return 0


def _failure(rank: int, exitcode: int, error_file: str) -> str:
    """``rank R failed: Error: message (traceback in FILE)``, or how the rank exited."""
    if not os.access(error_file, os.R_OK):
        if exitcode < 0:
            try:
                return f"rank {rank} was killed by {signal.Signals(-exitcode).name}"
            except ValueError:
                return f"rank {rank} was killed by signal {-exitcode}"
        return f"rank {rank} exited with code {exitcode}"
    with open(error_file, "rb") as handle:
        trace = pickle.load(handle)
    log.debug("rank %d failed:\n%s", rank, trace)
    lines = [line for line in trace.strip().splitlines() if line.strip()]
    fd, path = tempfile.mkstemp(prefix=f"zeroc-rank{rank}-", suffix=".txt")
    with os.fdopen(fd, "w") as handle:
        handle.write(trace)
    return f"rank {rank} failed: {lines[-1] if lines else 'an exception'} (traceback in {path})"


def _stop(processes: list, interrupt: bool) -> None:
    """End the ranks still running: SIGINT first if ``interrupt``, then SIGTERM, then
    SIGKILL, each after a grace period."""
    alive = [process for process in processes if process.is_alive()]
    steps = [(signal.SIGTERM, _TERMINATE_GRACE_S), (signal.SIGKILL, _TERMINATE_GRACE_S)]
    if interrupt:
        steps.insert(0, (signal.SIGINT, _INTERRUPT_GRACE_S))
    for signum, grace in steps:
        running = [process for process in alive if process.is_alive()]
        if not running:
            break
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signum)
        deadline = time.monotonic() + grace
        for process in running:
            process.join(max(0.0, deadline - time.monotonic()))


def _remove_error_files(paths: list) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
