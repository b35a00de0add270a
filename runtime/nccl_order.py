"""NCCL's rules for point-to-point transfers, checked on a CPU: record what each rank issues,
then match it the way NCCL would.

gloo matches a send with its receive by tag, on background threads, in whatever order the
two sides post them; NCCL does not. It matches in issue order on each communicator: the k-th
send from ``a`` to ``b`` meets the k-th receive at ``b`` from ``a``, and each transfer runs on a
CUDA stream, waiting there until its counterpart runs. Which communicator and stream is
torch's choice (``ProcessGroupNCCL``):

- a ``batch_isend_irecv`` group (every transfer zeroc issues) is one NCCL group call
  (``ncclGroupStart`` / ``ncclGroupEnd``) on the process group's communicator for the device,
  whatever the peers, and its stream: one stream per (process group, device) on a rank. The
  rank's groups therefore run one after another, in issue order, whichever peers they touch:
  a group waits for the one before it to finish even when the two share no peer. A group's
  transfers progress together, each finishing when its counterpart runs, and the group ends
  once all have.
- a lone ``isend`` / ``irecv`` runs on a communicator of its own pair of ranks and that
  pair's stream: lone transfers to different peers do not wait for each other.

So an order that runs on gloo can hang on a GPU cluster (1F1B at pp=2 posting ``send F0, recv
B0, send F1`` on one rank against ``recv F0, recv F1, send B0`` on the other), and one that
would run with a stream per peer can hang on the shared stream (three ranks, each batching a
send to the next before a receive from the previous: every rank's send waits for a receive
queued behind its peer's own send).

``recording()`` collects, per process, every transfer ``zeroc.runtime.pipeline.p2p`` issues (peer,
shape, dtype, device, and which batch it belongs to). ``find_deadlock`` takes every rank's
record and plays NCCL's matching: it returns ``None`` when every transfer completes, or a
report naming, for each rank still waiting, its first pending transfers, and the mismatch or
cycle that stops them. ``check`` raises ``P2PDeadlockError`` with that report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Mapping, Sequence

import torch

__all__ = ["P2PDeadlockError", "P2PRecord", "Transfer", "check", "find_deadlock", "record",
           "recording", "stream_of", "waited"]


class P2PDeadlockError(RuntimeError):
    """Point-to-point transfers NCCL could never match in the order they were issued."""


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One issued transfer: a send to or a receive from global rank ``peer``; ``batch``:
    the index of the ``batch_isend_irecv`` group it was issued in (``None``: alone)."""

    send: bool
    peer: int
    shape: tuple[int, ...]
    dtype: str
    device: str
    batch: int | None
    label: str = ""  # what the executor moved (``F3@s1``), for the report
    # How many waits (``P2PRecord.waits``) the rank had made when it issued this: a wait
    # blocks the host (gloo) or orders the streams (NCCL: the compute that reads a receive
    # runs after it, and a later send of that compute's output after the compute).
    waits_before: int = 0

    def describe(self) -> str:
        what = f"{'send to' if self.send else 'recv from'} {self.peer} {list(self.shape)}"
        return f"{what} ({self.label})" if self.label else what


@dataclasses.dataclass
class P2PRecord:
    """One rank's issued transfers in order, and the transfers it waited for, in order."""

    transfers: list[Transfer] = dataclasses.field(default_factory=list)
    waits: list[int] = dataclasses.field(default_factory=list)  # indices into transfers
    batches: int = 0


class _Recorder(threading.local):
    current: P2PRecord | None = None


_RECORDER = _Recorder()


@contextlib.contextmanager
def recording() -> Iterator[P2PRecord]:
    """Record the transfers this thread issues inside the block."""
    saved = _RECORDER.current
    _RECORDER.current = P2PRecord()
    try:
        yield _RECORDER.current
    finally:
        _RECORDER.current = saved


def record(pairs: Sequence[tuple[bool, torch.Tensor, int]], batched: bool,
           label: str = "", labels: Sequence[str] | None = None) -> tuple[int, ...]:
    """Note transfers ``(send, tensor, peer)`` being issued: together as one batch, or one by
    one; returns their indices (for ``waited``). Does nothing outside ``recording()``."""
    current = _RECORDER.current
    if current is None or not pairs:
        return ()
    batch = None
    if batched:
        batch, current.batches = current.batches, current.batches + 1
    start = len(current.transfers)
    for k, (send, tensor, peer) in enumerate(pairs):
        current.transfers.append(Transfer(
            send, int(peer), tuple(int(s) for s in tensor.shape),
            str(tensor.dtype).removeprefix("torch."), str(tensor.device), batch,
            labels[k] if labels is not None else label, len(current.waits)))
    return tuple(range(start, len(current.transfers)))


def waited(indices: Sequence[int]) -> None:
    """Note that the rank waited for the transfers ``record`` returned as ``indices``."""
    current = _RECORDER.current
    if current is not None:
        current.waits.extend(indices)


def _units(transfers: Sequence[Transfer]) -> list[list[int]]:
    """Issue order as launch units: a batch's transfers together, others one each."""
    units: list[list[int]] = []
    open_batch: dict[int, list[int]] = {}
    for i, transfer in enumerate(transfers):
        if transfer.batch is None:
            units.append([i])
        elif transfer.batch in open_batch:
            open_batch[transfer.batch].append(i)
        else:
            open_batch[transfer.batch] = [i]
            units.append(open_batch[transfer.batch])
    return units


def stream_of(transfer: Transfer) -> tuple[str, object]:
    """The communicator (and its stream) ``transfer`` runs on, on its rank: a batched one on
    the process group's communicator of its device, shared with every other batch of that
    rank; a lone one on its pair's own (module docstring). zeroc issues every transfer on the
    default process group, so the device names the communicator."""
    if transfer.batch is not None:
        return ("group", transfer.device)
    return ("pair", transfer.peer)


def find_deadlock(records: Mapping[int, P2PRecord], shown: int = 4) -> str | None:
    """Play NCCL's matching on every rank's issued transfers (module docstring); ``None``
    when all complete, else a report of what each waiting rank is stuck on.

    On each communicator the k-th send from ``a`` to ``b`` is the counterpart of the k-th
    receive at ``b`` from ``a`` (``stream_of``: batched transfers on the process group's, lone
    ones on their pair's). A launch unit (a batch, or one transfer) runs once it is the first
    unfinished unit of its rank on its stream (one per communicator: all of a rank's batches
    share one) and the transfers the rank waited for before issuing it are complete; a
    transfer completes once its unit and its counterpart's unit both run, and a unit once all
    its transfers have (NCCL progresses a group's transfers together, each finishing with
    its own counterpart)."""
    transfers = {r: rec.transfers for r, rec in records.items()}
    units = {r: _units(t) for r, t in transfers.items()}
    unit_of = {(r, i): u for r in records for u, members in enumerate(units[r])
               for i in members}
    # Counterparts: per communicator kind and direction, sends and receives in issue order.
    outgoing: dict[tuple[bool, int, int], list[int]] = {}
    incoming: dict[tuple[bool, int, int], list[int]] = {}
    for rank, listed in transfers.items():
        for i, t in enumerate(listed):
            (outgoing if t.send else incoming).setdefault(
                (t.batch is not None, rank, t.peer), []).append(i)
    counterpart: dict[tuple[int, int], tuple[int, int]] = {}
    problems: list[str] = []
    for (batched, src, dst), sends in outgoing.items():
        recvs = incoming.get((batched, dst, src), []) if dst in records else []
        for i, j in zip(sends, recvs, strict=False):
            mine, theirs = transfers[src][i], transfers[dst][j]
            if (mine.shape, mine.dtype) != (theirs.shape, theirs.dtype):
                problems.append(f"rank {src}'s {mine.describe()} meets rank {dst}'s "
                                f"{theirs.describe()} {theirs.dtype}: shapes or dtypes differ")
                continue
            counterpart[(src, i)], counterpart[(dst, j)] = (dst, j), (src, i)
    # Per rank and stream: the units on it, in issue order.
    streams: dict[tuple[int, tuple[str, object]], list[int]] = {}
    unit_streams: dict[tuple[int, int], list[tuple[int, tuple[str, object]]]] = {}
    for rank in records:
        for u, members in enumerate(units[rank]):
            keys = [(rank, key) for key in dict.fromkeys(
                stream_of(transfers[rank][i]) for i in members)]
            unit_streams[(rank, u)] = keys
            for key in keys:
                streams.setdefault(key, []).append(u)
    position = dict.fromkeys(streams, 0)
    finished = {r: [False] * len(units[r]) for r in records}

    def running(rank: int, u: int) -> bool:
        first = transfers[rank][units[rank][u][0]]
        if not all(finished[rank][unit_of[(rank, w)]]
                   for w in records[rank].waits[:first.waits_before]):
            return False
        return all(streams[key][position[key]] == u for key in unit_streams[(rank, u)])

    done = {r: [False] * len(t) for r, t in transfers.items()}
    progress = True
    while progress:
        progress = False
        for rank in records:
            for u in range(len(units[rank])):
                if finished[rank][u] or not running(rank, u):
                    continue
                for i in units[rank][u]:  # a transfer completes once both sides run
                    other = counterpart.get((rank, i))
                    if not done[rank][i] and other is not None and running(
                            other[0], unit_of[other]):
                        done[rank][i] = done[other[0]][other[1]] = True
                        progress = True
        for rank in records:
            for u, members in enumerate(units[rank]):
                if not finished[rank][u] and all(done[rank][i] for i in members):
                    finished[rank][u] = True  # its stream moves on
                    for key in unit_streams[(rank, u)]:
                        position[key] += 1
                    progress = True
    stuck = {r: [transfers[r][i] for u, members in enumerate(units[r]) if not finished[r][u]
                 for i in members] for r in records}
    stuck = {r: pending for r, pending in stuck.items() if pending}
    if not stuck:
        return None
    lines = problems[:shown]
    for rank, pending in sorted(stuck.items()):
        listed = "; ".join(t.describe() for t in pending[:shown])
        more = f"; ... ({len(pending)} pending)" if len(pending) > shown else ""
        lines.append(f"rank {rank} waits on: {listed}{more}")
    return "\n".join(lines)


def check(records: Mapping[int, P2PRecord], what: str) -> None:
    """Raise ``P2PDeadlockError`` when NCCL could not match ``records`` (``what``: which
    program they came from, for the message)."""
    report = find_deadlock(records)
    if report is not None:
        raise P2PDeadlockError(
            f"zeroc: {what}: the pipeline's point-to-point transfers would deadlock under "
            "NCCL, which matches a pair's sends and receives in the order each rank issues "
            "them and runs a rank's batched groups one after another on one stream (gloo "
            f"matches by tag and hides this):\n{report}")
