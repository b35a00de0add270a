"""A failed pipeline step ends on every rank: each raises within seconds, none pairs steps.

The ranks of a pipeline exchange each micro-batch's activations and gradients, so a step
that raises on one rank (its stage's compute, a transfer, Ctrl-C) cannot finish on the
others: they would wait for messages that never come, and a rank that went on to its next
step would pair that step's messages with its peers' pending ones (gloo and NCCL match a
pair's transfers in order). Three parts keep that from happening:

- Step numbers. Every rank counts its model's pipelined calls (``StepCounter``, one per
  model, shared by its compiled graphs). The count and whether the call trains ride in the
  batch signature the step all-gathers before it moves anything
  (``runtime/pipeline/inputs.check_same_shapes``, no extra collective): ranks at different
  steps, or one training while another runs ``no_grad``, raise ``StepMismatchError`` on
  every rank, naming both, before anything moves or is applied.
- Reporting. A step that raises after that check (``AbortWatch.report``) writes the first
  failure of the job (rank, step, exception) under ``ABORT_KEY`` in the job's c10d store
  (``torch_compat.default_store``), once, and the process keeps it (``_ABORTED``).
- Watched waits. A wait that blocks the host (gloo's, and the CPU all-gathers of every
  world) runs on a helper thread while the step's thread waits for it ``POLL_S`` at a time;
  each time it has not ended, the step's thread checks the store (one ``check`` round trip,
  only while a wait is slow: a steady step makes none), and raises ``PipelineAbortedError``
  naming the failing rank and its exception when a failure is there. A wait that ends in an
  error (a peer's process died and closed its connections) is named the same way when the
  store holds the failure. NCCL's waits are stream waits and block no host: they are waited
  directly, and an NCCL host meets the failure at its next blocking point, the next step's
  signature all-gather on the pipeline's gloo host group, which is watched.

Once a process saw a failure, no pipeline step of that job runs in it again: each call raises
``PipelineAbortedError`` at its start, before any transfer. The failed step's transfers may
still be pending (a posted receive, a send nobody receives, a collective only some ranks
joined) and would be paired with a later step's, so a step after a failure could silently
mix data; on NCCL they also hold the device's stream, so a rank aborts its NCCL groups
(``ProcessGroup.abort``) when it reports or sees a failure. Recovery is a restart of the job
(from the last checkpoint). A new default process group (a new job in the same process)
starts clean. Not seen: an exception a rank raises outside a pipelined call (its loop skips a
call): the ranks' calls pair in the order they are made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from zeroc.runtime.mesh import resolve_group
from zeroc.runtime.torch_compat import default_store

__all__ = ["ABORT_KEY", "POLL_S", "AbortRecord", "AbortWatch", "PipelineAbortedError",
           "StepCounter", "StepMismatchError", "wait"]

log = logging.getLogger(__name__)

ABORT_KEY = "zeroc/pipeline_abort"
POLL_S = 0.5  # how long a blocking wait runs before each look at the store
_MAX_TEXT = 2000


class PipelineAbortedError(RuntimeError):
    """A pipeline step failed on some rank of the job; this rank stops too."""

    def __init__(self, record: AbortRecord, step: int, where: str) -> None:
        self.record, self.step = record, step
        super().__init__(
            f"zeroc pipeline: step {record.step} failed on rank {record.rank} "
            f"({record.error}); this rank stopped {where} (its step {step}). The ranks of a "
            "pipeline exchange every micro-batch, so a step that failed on one rank cannot "
            "finish on the others, and its pending transfers would be paired with a later "
            "step's: no later pipeline step runs in this job. Restart it (from the last "
            "checkpoint)")


class StepMismatchError(RuntimeError):
    """The ranks of a pipeline are at different steps (or train and evaluate at once)."""


@dataclasses.dataclass(frozen=True)
class AbortRecord:
    """The first failure of a job: where it was and what was raised."""

    rank: int
    step: int
    error: str

    def encode(self) -> str:
        return f"{self.rank}\t{self.step}\t{self.error}"

    @staticmethod
    def decode(text: bytes | str) -> AbortRecord:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        rank, step, error = (text.split("\t", 2) + ["", ""])[:3]
        return AbortRecord(int(rank or -1), int(step or -1), error)


class StepCounter:
    """A model's pipelined calls on this rank: every call takes the next number."""

    def __init__(self) -> None:
        self.count = 0

    def next(self) -> int:
        self.count += 1
        return self.count


# The failure this process saw, per default process group (a weak reference: the key only).
_ABORTED: list[tuple[Any, AbortRecord]] = []
_CURRENT = threading.local()  # .watch: the AbortWatch of the step this thread runs


def _world() -> Any:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _seen() -> AbortRecord | None:
    world = _world()
    _ABORTED[:] = [(g, r) for g, r in _ABORTED if g() is not None]  # groups destroyed since
    return next((r for g, r in _ABORTED if g() is world), None) if world is not None else None


def _remember(record: AbortRecord) -> None:
    world = _world()
    if world is not None and _seen() is None:
        _ABORTED.append((weakref.ref(world), record))


class _Pending:
    def __init__(self, work: Any) -> None:
        self.work, self.error = work, None
        self.done = threading.Event()


class _Waiter:
    """One daemon thread that waits for the works handed to it, in order; it ends after
    ``_IDLE_S`` without one (the next wait starts another)."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="zeroc-pipeline-wait", daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                pending = self.queue.get(timeout=_IDLE_S)
            except queue.Empty:
                with _LOCK:
                    if self.queue.empty():
                        if _WAITER and _WAITER[0] is self:
                            _WAITER.clear()
                        return
                continue
            try:
                pending.work.wait()
            except BaseException as error:  # noqa: BLE001 (handed to the waiting thread)
                pending.error = error
            # Hold no work between waits: a finished work holds its group's gloo context,
            # which a destroyed group must not keep alive at exit.
            pending.work = None
            pending.done.set()
            del pending


_WAITER: list[_Waiter] = []  # the helper thread; replaced when a wait on it was abandoned
_LOCK = threading.Lock()
_IDLE_S = 10.0


def _submit(pending: _Pending) -> None:
    with _LOCK:
        if not _WAITER:
            _WAITER.append(_Waiter())
        _WAITER[0].queue.put(pending)


class AbortWatch:
    """One executor's side of the module docstring: its step's waits and its reports.

    ``real``: a run on real process groups (a planned world's fake ones are waited directly
    and report nothing); ``groups``: the names of the groups the step uses, aborted on NCCL
    when a failure is seen."""

    def __init__(self, real: bool, groups: tuple[str, ...] = ()) -> None:
        self.real, self.groups = real, groups
        self.step = 0
        self.device = torch.device("cpu")
        self._looked = False  # whether this executor looked at the store once

    @contextlib.contextmanager
    def active(self, step: int) -> Iterator[None]:
        """Run step ``step`` with this watch: raise first if the job saw a failure."""
        self.step = step
        record = _seen() if self.real else None
        if record is None and self.real and not self._looked:  # once per executor
            self._looked = True
            record = self._poll()
        if record is not None:
            self._abort_groups()
            raise PipelineAbortedError(record, step, "before its step began")
        outer = getattr(_CURRENT, "watch", None)
        _CURRENT.watch = self
        try:
            yield
        finally:
            _CURRENT.watch = outer

    def report(self, error: BaseException) -> None:
        """Tell the job that this rank's step failed with ``error`` (the first report of a
        job stays); a rank that stopped for another's failure reports nothing."""
        if not self.real or isinstance(error, PipelineAbortedError):
            return
        rank = dist.get_rank() if dist.is_initialized() else 0
        text = f"{type(error).__name__}: {error}".replace("\t", " ")[:_MAX_TEXT]
        record = AbortRecord(rank, self.step, text)
        _remember(record)
        store = default_store()
        if store is not None:
            try:
                store.compare_set(ABORT_KEY, "", record.encode())
            except (RuntimeError, ValueError) as failure:
                log.warning("zeroc: could not report a failed pipeline step: %s", failure)
        log.error("zeroc: pipeline step %d failed on this rank: %s", self.step, text)
        self._abort_groups()

    def _poll(self) -> AbortRecord | None:
        store = default_store()
        try:
            if store is None or not store.check([ABORT_KEY]):
                return None
            record = AbortRecord.decode(store.get(ABORT_KEY))
        except (RuntimeError, ValueError):  # the store went away with its host: say nothing
            return None
        _remember(record)
        return record

    def _abort_groups(self) -> None:
        """Abort this step's NCCL groups: a failed step's transfers hold their streams."""
        groups = [resolve_group(name) for name in self.groups] + [_world()]
        for group in {id(g): g for g in groups if g is not None}.values():
            try:
                if "nccl" in str(dist.get_backend(group)):
                    group.abort()
            except (RuntimeError, ValueError, AttributeError) as failure:
                log.warning("zeroc: could not abort a pipeline's NCCL group: %s", failure)

    def wait(self, work: Any, what: str) -> None:
        """Wait for ``work`` on the helper thread, looking at the store while it is slow."""
        pending = _Pending(work)
        _submit(pending)
        while not pending.done.wait(POLL_S):
            record = self._poll()
            if record is not None:
                with _LOCK:  # that thread may never come back: the next wait gets another
                    _WAITER.clear()
                self._abort_groups()
                raise PipelineAbortedError(record, self.step, f"waiting for {what}")
        if pending.error is not None:
            record = self._poll()
            if record is not None:
                raise PipelineAbortedError(record, self.step,
                                           f"waiting for {what}") from pending.error
            raise pending.error


def wait(work: Any, device: torch.device | None = None, what: str = "a transfer") -> None:
    """Wait for ``work``: watched (module docstring) inside a step of a real run when the wait
    blocks the host (its tensors on the CPU; ``device`` None: the step's device), else
    directly."""
    if work is None:
        return
    watch = getattr(_CURRENT, "watch", None)
    if watch is None or not watch.real or (device or watch.device).type != "cpu":
        work.wait()
        return
    watch.wait(work, what)
