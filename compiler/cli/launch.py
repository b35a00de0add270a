"""Run a function on N local gloo ranks and collect what each rank returns.

``run_ranks(fn, world_size, *args, timeout=120)`` starts ``world_size`` ranks, each joining
a gloo process group on 127.0.0.1 through a TCPStore the parent owns (so no port can be
taken between picking and using it) and running one thread, calls
``fn(rank, world_size, *args)`` on every rank and returns the list of per-rank results. The
tests use it through ``tests/dist_harness.py``; the multi-process benchmarks import it.

``fn`` and its arguments and results must be picklable (a module-level function of an
importable module). An exception on any rank is re-raised in the parent as ``RankError``
with the traceback of every rank that failed, first reported first; the other ranks (often
blocked in a collective) get a short grace period to report theirs and are then stopped.
A rank that ends without a report (a crash, ``os._exit``) is named first, with its signal or
exit code. When ``timeout`` seconds pass first, the ranks still running print their stacks
(faulthandler), are killed, and ``RankTimeout`` names them. Only the processes this call
started are ever signalled.

The processes are started by ``zeroc.cli._rank_processes`` (torch's ``start_processes`` from a
forkserver that has already imported torch, or spawn where there is none; the demo's
launcher ``zeroc.cli.local_ranks`` shares it), so only the first call pays for importing torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from zeroc.cli._rank_processes import Ranks, how_it_ended, start_ranks

__all__ = ["run_ranks", "RankError", "RankTimeout"]

log = logging.getLogger(__name__)

_GRACE_AFTER_ERROR_S = 2.0
_EXIT_WAIT_S = 3.0  # how long ranks that all reported get to exit by themselves
_STORE_TIMEOUT_S = 60.0


class RankError(RuntimeError):
    """A rank raised; the message carries the rank number and its traceback."""


class RankTimeout(RuntimeError):
    """Ranks were still running when the timeout passed."""


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
    with start_ranks(fn, world_size, args, store_timeout_s=_STORE_TIMEOUT_S) as ranks:
        if ranks.interrupted:
            raise KeyboardInterrupt  # Ctrl-C while the ranks started; leaving stops them
        values = _collect(ranks, timeout, may_exit)
        ranks.stop(wait_s=_EXIT_WAIT_S)
        return values


def _collect(ranks: Ranks, timeout: float, may_exit: frozenset[int]) -> list[Any]:
    """Every rank's result, or ``RankError`` / ``RankTimeout`` saying what went wrong."""
    world = ranks.world
    done: dict[int, Any] = {}  # rank -> its result (None: it raised or ended without one)
    failures: list[tuple[int, str]] = []  # (rank, traceback), first reported first
    silent: dict[int, int] = {}  # rank -> exit code, for ranks that ended without a report
    deadline = time.monotonic() + timeout
    while len(done) < world:
        events = ranks.wait(deadline)
        if not events:
            break  # the time is up
        for event in events:
            if event.kind == "result":
                done[event.rank] = event.value
            elif event.kind == "raised":
                if not failures:
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR_S)
                failures.append((event.rank, event.value))
                done[event.rank] = None
            elif event.rank not in done:  # exited without reporting
                done[event.rank] = None
                if event.rank in may_exit:
                    continue
                silent[event.rank] = event.value
                if not failures:
                    raise RankError(_silent_rank(event.rank, event.value, world))
    if failures:
        # A rank that crashed or still runs is usually the cause of the others' errors
        # ("Connection closed by peer"), so it is named first.
        lines = [_silent_rank(rank, silent.get(rank), world) for rank in range(world)
                 if rank in silent or rank not in done]
        lines += [f"rank {rank} of {world} raised:\n{trace}" for rank, trace in failures]
        raise RankError("\n".join(lines))
    if len(done) < world:
        running = [rank for rank in range(world) if rank not in done]
        log.debug("ranks %s timed out; dumping their stacks", running)
        ranks.stop(dump=True)
        raise RankTimeout(f"ranks {running} of {world} did not finish within {timeout} s")
    return [done[rank] for rank in range(world)]


def _silent_rank(rank: int, exitcode: int | None, world: int) -> str:
    """What became of a rank that reported nothing: its exit code or signal, or running."""
    if exitcode is None:
        return f"rank {rank} of {world} had not finished (no result, no error)"
    return f"rank {rank} of {world} {how_it_ended(exitcode)} without reporting a result"
