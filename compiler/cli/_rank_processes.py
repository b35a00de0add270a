"""Start N local ranks with torch's own ``start_processes`` and hear what each one reports.

The one implementation behind ``zeroc.cli.launch.run_ranks`` (the tests' and benchmarks'
launcher: every rank's result, or an exception naming the ranks that failed) and
``zeroc.cli.local_ranks.run_local_ranks`` (the demo's and the tuner's: one line and an exit
code). It is private: neither the package nor the README offers it.

:func:`start_ranks` creates a ``TCPStore`` the parent owns (port 0, so no port can be taken
between picking and using it) and starts ``world`` processes with
``torch.multiprocessing.start_processes``, forked from a forkserver that has already imported
torch, ``torch.distributed``, the compile path (Dynamo, AOTAutograd, Inductor's entry, zeroc's
backend) and the modules ``ZEROC_RANK_PRELOAD`` names (spawn where there is no forkserver),
so only the first start in a process pays for importing them. SIGINT is ignored while they start
(a forkserver started then passes that on to every rank it forks), until each rank installs
its own handler. Every rank takes the parent's environment of the moment, runs one thread on
CPU (gloo) or uses GPU ``rank`` (NCCL, the group bound to it: ``init_group``'s ``device_id``),
joins the group, calls ``fn(rank, world, *args)`` and
sends one message through a pipe of its own: its pickled result, or the traceback of what it
raised, sent before the group is torn down so that the first report is the cause. It then
exits through multiprocessing's bootstrap (its finalizers run; a forkserver's child skips the
interpreter's teardown).

:class:`Ranks` turns those messages and the processes' exits into :class:`Event` s and
:meth:`Ranks.stop` ends the ranks still running (optionally a faulthandler dump of their
stacks, then a first signal such as SIGINT, then SIGTERM, then SIGKILL, each after a grace
period). Only the processes a :class:`Ranks` started are ever signalled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

INTERRUPTED = 130  # the shell's exit code for a process ended by SIGINT
HOST = "127.0.0.1"
# What the forkserver imports once, so that no rank pays for it: torch, the compile path
# every rank's first ``torch.compile`` walks (Dynamo, AOTAutograd, Inductor's entry, zeroc's
# backend) and the modules named in ``PRELOAD_ENV``. None of them starts a thread or touches
# a device when imported, so forking after them is safe.
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch._functorch.aot_autograd",
            "torch._inductor.compile_fx", "zeroc", "zeroc.frontend.backend",
            "zeroc.cli._rank_processes")
PRELOAD_ENV = "ZEROC_RANK_PRELOAD"  # comma-separated modules, e.g. "transformers"
_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)  # faulthandler prints a rank's stacks on it
_DUMP_PAUSE_S = 0.5
_INTERRUPT_KEY = "zeroc/interrupted"  # set in the store before SIGINT reaches the ranks
_JOINED_KEY = "zeroc/joined"  # one key per rank that is in the process group
_FIRST_GRACE_S = 3.0
_TERMINATE_GRACE_S = 5.0


@dataclasses.dataclass(frozen=True)
class Event:
    """What one rank did: ``result`` (``value`` is what ``fn`` returned), ``raised`` (``value``
    is the traceback) or ``exited`` (``value`` is the exit code, negative for a signal)."""

    kind: str
    rank: int
    value: Any


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What every rank needs to know, pickled once per rank by ``start_processes``."""

    fn: Callable[..., Any]
    world: int
    args: tuple
    port: int
    device: str
    parent: int
    env: dict[str, str]
    command: bool
    store_timeout_s: float


def backend_for(device: str) -> str:
    """The process-group backend for ``device``: ``nccl`` on ``cuda``, ``gloo`` on ``cpu``."""
    return "nccl" if device == "cuda" else "gloo"


def init_group(device: str, local_rank: int, **kwargs: Any) -> None:
    """``init_process_group`` with ``device``'s backend and ``kwargs`` (store, rank, world
    size; none: torchrun's environment). On ``cuda`` the NCCL group is bound to GPU
    ``local_rank`` (``device_id``): its communicator is made there at once, and the groups
    split from it later (the mesh's) are made on that GPU too, not on whichever device is
    current when their first collective runs. gloo on the CPU is left as it was."""
    if device == "cuda":
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(backend_for(device), **kwargs)


def how_it_ended(exitcode: int | None) -> str:
    """``was killed by SIGKILL``, ``exited with code 3``, or ``had not finished`` (``None``)."""
    if exitcode is None:
        return "had not finished"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT in this process for the block (only the main thread can)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def start_ranks(fn: Callable[..., Any], world: int, args: tuple = (), *, device: str = "cpu",
                command: bool = False, store_timeout_s: float = 300.0) -> Ranks:
    """Start ``world`` ranks running ``fn(rank, world, *args)``; the :class:`Ranks`.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). ``command`` gives
    a command's semantics: Ctrl-C ends a rank with exit code 130 and no report, and an
    ``int`` other than 0 that ``fn`` returns is also the rank's exit code.
    """
    store = dist.TCPStore(HOST, 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=store_timeout_s))
    pipes = [multiprocessing.Pipe(duplex=False) for _ in range(world)]
    spec = _Spec(fn, world, tuple(args), store.port, device, os.getpid(), dict(os.environ),
                 command, store_timeout_s)
    method = _start_method()
    log.debug("starting %d %s ranks (%s, port %d)", world, device, method, store.port)
    try:
        with _starting(device, method) as interrupted:
            context = torch.multiprocessing.start_processes(
                _rank_main, args=(spec, [writer for _, writer in pipes]), nprocs=world,
                join=False, daemon=False, start_method=method)
    except BaseException:
        for reader, _ in pipes:
            reader.close()
        raise
    finally:
        for _, writer in pipes:
            writer.close()
    return Ranks(context, [reader for reader, _ in pipes], store, bool(interrupted))


def _start_method() -> str:
    """``forkserver`` with torch and zeroc preloaded where there is one, else ``spawn``."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    # Takes effect when the forkserver starts, the first time any process uses it; a module
    # that does not import is skipped there (multiprocessing's rule).
    extra = [m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip()]
    multiprocessing.get_context("forkserver").set_forkserver_preload([*_PRELOAD, *extra])
    return "forkserver"


@contextlib.contextmanager
def _starting(device: str, method: str) -> Iterator[list[int]]:
    """While ranks start: on CPU ``OMP_NUM_THREADS=1`` (what a spawned rank or a new
    forkserver inherits), and SIGINT kept from the ranks until each installs its handler in
    :func:`_rank_main`. Spawned ranks inherit it ignored, as does a forkserver started here
    (and every rank it forks); the wait for the forkserver's first fork (its imports) defers
    SIGINT instead: the list yielded gets the signal numbers that came meanwhile."""
    saved = os.environ.get("OMP_NUM_THREADS")
    if device == "cpu":
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        if method == "spawn":
            with sigint_ignored():
                yield []
            return
        with sigint_ignored():
            multiprocessing.forkserver.ensure_running()
        with _sigint_deferred() as interrupted:
            yield interrupted
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[list[int]]:
    """Record SIGINT (main thread only) in the list yielded instead of raising."""
    interrupted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


class Ranks:
    """Started ranks: their processes, what they report (:meth:`wait`) and :meth:`stop`.

    ``interrupted`` says SIGINT came while they started (the caller decides what it means).
    As a context manager it stops whatever still runs on exit and removes its files.
    """

    def __init__(self, context: Any, readers: list, store: dist.TCPStore,
                 interrupted: bool = False) -> None:
        self.interrupted = interrupted
        self.processes = list(context.processes)
        self._error_files = list(context.error_files)
        self._readers = dict(enumerate(readers))  # rank -> pipe not read yet
        self._alive = set(range(len(self.processes)))  # ranks whose exit is not reported yet
        self._store = store  # the ranks' store lives as long as they do

    @property
    def world(self) -> int:
        """How many ranks were started."""
        return len(self.processes)

    def wait(self, until: float | None = None) -> list[Event]:
        """The next events, waiting for one until ``time.monotonic()`` passes ``until`` (no
        limit when ``None``); ``[]`` when the time is up or every rank exited and reported.
        A rank's message always comes before its exit."""
        while self._alive or self._readers:
            sentinels = {self.processes[rank].sentinel: rank for rank in self._alive}
            readers = {reader: rank for rank, reader in self._readers.items()}
            timeout = None if until is None else max(0.0, until - time.monotonic())
            ready = multiprocessing.connection.wait([*readers, *sentinels], timeout)
            if not ready:
                return []
            events = [self._receive(readers[r]) for r in ready if r in readers]
            for rank in sorted(sentinels[s] for s in ready if s in sentinels):
                if rank in self._readers and self._readers[rank].poll():
                    events.append(self._receive(rank))
                self.processes[rank].join()
                self._alive.discard(rank)
                events.append(Event("exited", rank, self.processes[rank].exitcode))
            events = [event for event in events if event is not None]
            if events:
                return events
        return []

    def _receive(self, rank: int) -> Event | None:
        """The one message of ``rank``'s pipe (``None`` if it closed without one)."""
        reader = self._readers.pop(rank)
        try:
            data = reader.recv_bytes()
        except (EOFError, OSError):
            return None
        finally:
            reader.close()
        kind, value = pickle.loads(data)
        return Event(kind, rank, value)

    def stop(self, first: int | None = None, *, wait_s: float = 0.0, dump: bool = False) -> None:
        """End the ranks still running: let them exit for ``wait_s``; with ``dump``, have
        faulthandler print their stacks; then signal ``first`` (e.g. SIGINT), SIGTERM and
        SIGKILL, each after a grace period."""
        deadline = time.monotonic() + wait_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        steps: list[tuple[int, float]] = []
        if dump and _DUMP_SIGNAL is not None:
            steps.append((_DUMP_SIGNAL, _DUMP_PAUSE_S))
        if first is not None:
            steps.append((first, _FIRST_GRACE_S))
        if first == signal.SIGINT and self._store is not None:
            # A rank that installs its SIGINT handler after the signal came sees this instead.
            with contextlib.suppress(Exception):
                self._store.set(_INTERRUPT_KEY, "1")
        steps += [(signal.SIGTERM, _TERMINATE_GRACE_S), (signal.SIGKILL, _TERMINATE_GRACE_S)]
        for signum, grace in steps:
            running = [process for process in self.processes if process.is_alive()]
            if not running:
                break
            log.debug("sending %s to ranks %s", signal.Signals(signum).name,
                      [self.processes.index(process) for process in running])
            for process in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)
            if signum == _DUMP_SIGNAL:
                time.sleep(grace)
                continue
            deadline = time.monotonic() + grace
            for process in running:
                process.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop what still runs, close the pipes and remove torch's error files."""
        try:
            self.stop()
        finally:
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()
            for path in self._error_files:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            self._store = None

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rank_main(rank: int, spec: _Spec, writers: list) -> None:
    """One rank, as torch's ``start_processes`` calls it: report once, then exit."""
    signal.signal(signal.SIGINT, _interrupt_once if spec.command else signal.default_int_handler)
    writer = writers[rank]
    for other in writers:
        if other is not writer:
            other.close()
    os.environ.clear()
    os.environ.update(spec.env)
    faulthandler.enable()  # a crash (e.g. SIGSEGV) prints every thread's Python stack
    if _DUMP_SIGNAL is not None:
        faulthandler.register(_DUMP_SIGNAL, all_threads=True)
    data, code, grouped = None, 0, False
    try:
        if not _alive(spec.parent):  # the parent ended while this rank was starting
            raise KeyboardInterrupt
        if spec.device == "cuda":
            torch.cuda.set_device(rank)
        else:
            os.environ["OMP_NUM_THREADS"] = "1"
            torch.set_num_threads(1)
        store = dist.TCPStore(HOST, spec.port, spec.world, is_master=False,
                              timeout=datetime.timedelta(seconds=spec.store_timeout_s))
        if store.check([_INTERRUPT_KEY]):  # stopped before its SIGINT handler was in place
            raise KeyboardInterrupt
        init_group(spec.device, rank, store=store, rank=rank, world_size=spec.world)
        grouped = True
        # Wait until every rank is in the group: one that returned at once and tore its group
        # down could otherwise break a peer still connecting (gloo's connectFullMesh).
        store.set(f"{_JOINED_KEY}/{rank}", "1")
        store.wait([f"{_JOINED_KEY}/{r}" for r in range(spec.world)])
        value = spec.fn(rank, spec.world, *spec.args)
        grouped = False
        dist.destroy_process_group()
        # Plain pickle copies tensors by value (torch's reductions for multiprocessing would
        # share them through file descriptors that vanish when this process exits).
        data = pickle.dumps(("result", value))
        if spec.command and isinstance(value, int) and not isinstance(value, bool):
            code = value
    except BaseException as error:
        if spec.command and isinstance(error, KeyboardInterrupt):
            code = INTERRUPTED
        else:
            data, code = pickle.dumps(("raised", traceback.format_exc())), 1
    if data is not None:
        with contextlib.suppress(OSError):
            writer.send_bytes(data)
    writer.close()
    if grouped:  # after the report: closing the group makes the peers fail too
        with contextlib.suppress(BaseException):
            dist.destroy_process_group()
    # Through multiprocessing's exit, which runs its finalizers (unlinking semaphores such as
    # tqdm's lock); a forkserver's child then ends without the interpreter's teardown.
    sys.exit(code)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def _interrupt_once(signum: int, frame: Any) -> None:
    """SIGINT in a command's rank: raise ``KeyboardInterrupt`` once, ignore any further one."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt
