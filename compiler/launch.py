"""Run a function on N local gloo ranks and collect what each rank returns.

``run_ranks(fn, world_size, *args, timeout=120)`` starts ``world_size`` Python processes,
initializes a gloo process group on 127.0.0.1 through a TCPStore the parent owns (so no port
can be taken between picking and using it), pins every rank to one thread,
calls ``fn(rank, world_size, *args)`` and returns the list of per-rank results.

``fn`` and its arguments and results must be picklable (a module-level function of an
importable module). An exception on any rank is re-raised in the parent as ``RankError`` with
the traceback of every rank that failed, first reported first; the other ranks (often blocked
in a collective) are then stopped. When
``timeout`` seconds pass first, the ranks still running are killed and ``RankTimeout`` names
them. Only the processes this call started are ever signalled.

Ranks are forked from a ``multiprocessing`` forkserver that has already imported torch (spawn
where forkserver is unavailable), so only the first call pays for importing torch.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_ranks", "RankError", "RankTimeout"]

_HOST = "127.0.0.1"
_GRACE_AFTER_ERROR_S = 2.0


class RankError(RuntimeError):
    """A rank raised; the message carries the rank number and its traceback."""


class RankTimeout(RuntimeError):
    """Ranks were still running when the timeout passed."""


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    results: multiprocessing.Queue,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    faulthandler.enable()  # a crash (e.g. SIGSEGV) prints every thread's Python stack
    try:
        store = dist.TCPStore(
            _HOST, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=60)
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        dist.destroy_process_group()
        # Plain pickle copies tensors by value (the Queue's pickler would share them through
        # file descriptors that vanish when this process exits).
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        # Report before the group is torn down: closing it makes peers fail too, and the
        # first report should be the cause.
        results.put((rank, False, traceback.format_exc()))
    # Skip the interpreter's slow teardown once the result is flushed to the parent.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _context() -> multiprocessing.context.BaseContext:
    """A forkserver that imported torch and Dynamo once, so later ranks start in milliseconds."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "zeroc"])
    return context


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120,
    may_exit: frozenset[int] = frozenset(),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their results.

    Ranks in ``may_exit`` are allowed to end without a result (their entry is ``None``): the
    others are awaited, e.g. to see how they react to a rank that died.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} is not allowed: it must be >= 1")
    context = _context()
    results = context.Queue()
    store = dist.TCPStore(
        _HOST, 0, None, is_master=True, timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    saved_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    processes = []
    try:
        for rank in range(world_size):
            process = context.Process(
                target=_rank_main,
                args=(fn, rank, world_size, store.port, args, results),
                daemon=True,
            )
            process.start()
            processes.append(process)
    finally:
        if saved_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_threads
    try:
        return _collect(processes, results, world_size, timeout, may_exit)
    finally:
        _stop(processes)
        del store


def _collect(
    processes: list, results: multiprocessing.Queue, world_size: int, timeout: float,
    may_exit: frozenset[int],
) -> list[Any]:
    values: dict[int, Any] = {}
    failures: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout
    while len(values) < world_size:
        now = time.monotonic()
        if now >= deadline:
            running = [r for r in range(world_size) if r not in values]
            if failures:
                break
            raise RankTimeout(
                f"ranks {running} of {world_size} did not finish within {timeout} s"
            )
        try:
            rank, ok, value = results.get(timeout=min(0.2, deadline - now))
        except queue.Empty:
            for r in may_exit:
                if r not in values and not processes[r].is_alive():
                    values[r] = None
            dead = [
                r for r, p in enumerate(processes)
                if r not in values and not p.is_alive() and p.exitcode not in (0, None)
            ]
            if dead and not failures and results.empty():
                raise RankError(_silent_rank(dead[0], processes[dead[0]], world_size)) from None
            continue
        if ok:
            values[rank] = pickle.loads(value)
            continue
        if not failures:
            deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR_S)
        failures.append((rank, value))
        values[rank] = None
    if failures:
        # A rank that crashed (a signal) or still runs is usually the cause of the others'
        # errors ("Connection closed by peer"), so it is named first.
        silent = [_silent_rank(r, processes[r], world_size) for r in range(world_size)
                  if r not in values]
        raised = [f"rank {rank} of {world_size} raised:\n{trace}" for rank, trace in failures]
        raise RankError("\n".join(silent + raised))
    return [values[r] for r in range(world_size)]


def _silent_rank(rank: int, process: Any, world_size: int) -> str:
    """What became of a rank that reported nothing: its exit code or signal, or still running."""
    if process.is_alive():
        return f"rank {rank} of {world_size} had not finished (no result, no error)"
    code = process.exitcode
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return f"rank {rank} of {world_size} {how} without reporting a result"


def _stop(processes: list) -> None:
    deadline = time.monotonic() + 3.0
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
