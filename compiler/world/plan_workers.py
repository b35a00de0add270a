"""Plan a world's pipeline positions on two CPU cores: half of them in a forked helper.

``zeroc.explain(model, inputs, world=W, pp=P)`` plans each of the ``P`` positions with one
fake training step (``zeroc.world.fake_world.plan_position``). What every position shares (Dynamo's
trace and the pipeline front: ``zeroc.world.plan_capture``, ``zeroc.pipeline.pipeline_front``) is
built
first, in this process (``zeroc.world.fake_world.share_front``); after it the positions are
independent: each makes its own fake process group, parallelizes its own copy of the model,
compiles the stages it runs and runs its own step. With two or more cores at hand
``plan_positions`` forks one helper process, which inherits everything built so far and
plans some of the positions while this process plans the others; the helper sends its
``PositionPlan`` objects back pickled through a file and exits without running anything else
of this process.

Which positions go where (``split_positions``): a process compiles each distinct stage program
it runs once (``zeroc.pipeline.stage_reuse``) and runs one fake step per position, so positions are
grouped by the programs they run and the groups divided to even the two processes' estimated
work: per graph node, a compile weighs ``COMPILE_PER_NODE`` and a step 1 plus
``STEP_PER_MICROBATCH`` per micro-batch. A Llama cut into 8 stages has three programs (first,
middle, last): the helper takes the two ends, this process the six middle positions, and no
program is compiled twice; halves would compile the middle program in both.

While a world is planned Python's cyclic collector runs only its young collections
(``full_collections_deferred``): planning makes millions of short-lived objects, and each
full collection walks everything the process holds (torch, the model, Dynamo's caches: 0.2 to
0.5 s a time, about 1.4 s of a 7B plan in each process, and in the helper it also copies every
page it touches from the parent). Young garbage, which is what a step frees, is collected as
before; cycles that lived long are freed by the first full collection after planning (the
helper exits without one). ``torch.distributed.checkpoint``'s state-dict helpers turn the
collector off outright for the same reason.

Nothing depends on the helper: if it fails, is killed or takes far longer than this process
took for its own half, this process plans its positions itself (a genuine error then
surfaces here, with its traceback). Planning is the same either way (tested): the helper
runs the same code on the same inherited state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import pickle
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["COMPILE_PER_NODE", "STEP_PER_MICROBATCH", "PositionWork",
           "full_collections_deferred", "plan_positions", "planning_cores", "split_positions"]

log = logging.getLogger(__name__)

# The helper may take this many times as long as this process's own half (and at least
# ``_MIN_WAIT_S``) before it is given up on.
_WAIT_FACTOR = 4.0
_MIN_WAIT_S = 120.0

# What planning a stage costs, in one unit per graph node: compiling its program
# (AOTAutograd's joint graph, the passes, the partition) ``COMPILE_PER_NODE``, one fake
# training step ``1 + STEP_PER_MICROBATCH * micro-batches`` (a step runs the stage's graphs
# once per micro-batch, and parallelizes, steps the optimizer and measures once). Fit to the
# Llama-shaped plans: 7B at 16 micro-batches (a middle stage's compile 3.8-4.3 s against a
# 1.2 s step) and 70B at 32 (5.9 s against 2.2 s).
COMPILE_PER_NODE = 4.6
STEP_PER_MICROBATCH = 1 / 46

# The oldest generation's threshold while a world is planned: Python runs a full collection
# after this many young (generation 1) collections, so none while planning (about 130 in a
# 7B plan); generations 0 and 1 keep their thresholds.
_DEFERRED_FULL_THRESHOLD = 1_000_000

# Above this many distinct groups of positions the split is by halves (the search is 2^groups).
_MAX_GROUPS = 8


@dataclasses.dataclass(frozen=True)
class PositionWork:
    """What planning one position costs, in any one unit: the programs it compiles (each
    paid once per process) and its step."""

    programs: tuple[tuple[Any, float], ...]  # (program key, cost of compiling it)
    step: float


def _cost(chosen: list[int], work: dict[int, PositionWork]) -> float:
    programs: dict[Any, float] = {}
    for p in chosen:
        programs.update(work[p].programs)
    return sum(programs.values()) + sum(work[p].step for p in chosen)


def split_positions(positions: list[int],
                    work: dict[int, PositionWork] | None) -> tuple[list[int], list[int]]:
    """(the helper's positions, this process's), both non-empty, in ``positions`` order.

    Positions that run the same programs form a group; every way of giving whole groups to
    one side, and of dividing one group between the sides, is tried, and the division whose
    larger estimated cost is least wins (ties: the least total, i.e. the fewer programs
    compiled twice; then the first found). Without ``work``, or with more than
    ``_MAX_GROUPS`` groups: halves."""
    half = (len(positions) + 1) // 2
    halves = positions[:half], positions[half:]
    if work is None:
        return halves
    groups: dict[tuple[Any, ...], list[int]] = {}
    for p in positions:
        groups.setdefault(tuple(key for key, _ in work[p].programs), []).append(p)
    members = list(groups.values())
    if len(members) > _MAX_GROUPS:
        return halves

    def score(side: set[int]) -> tuple[float, float]:
        theirs = [p for p in positions if p in side]
        mine = [p for p in positions if p not in side]
        return max(_cost(theirs, work), _cost(mine, work)), _cost(theirs, work) + _cost(
            mine, work)

    best, best_score = None, None
    for mask in range(1, 1 << len(members)):
        whole = [g for i, g in enumerate(members) if mask >> i & 1]
        candidates = [{p for g in whole for p in g}]
        for j, group in enumerate(members):  # one group divided: its first k on the side
            if not mask >> j & 1:
                others = {p for g in whole for p in g}
                candidates.extend(others | set(group[:k]) for k in range(1, len(group)))
        for side in candidates:
            if not side or len(side) == len(positions):
                continue
            value = score(side)
            if best_score is None or value < best_score:
                best, best_score = side, value
    if best is None:
        return halves
    theirs = [p for p in positions if p in best]
    mine = [p for p in positions if p not in best]
    if positions[0] not in theirs:  # the helper takes the side with the first position
        theirs, mine = mine, theirs
    return theirs, mine


@contextlib.contextmanager
def full_collections_deferred() -> Iterator[None]:
    """Run only the cyclic collector's young collections inside the block (see the module
    docstring); the thresholds the caller had are back afterwards, also on an error."""
    thresholds = gc.get_threshold()
    young, middle, full = thresholds
    gc.set_threshold(young, middle, max(full, _DEFERRED_FULL_THRESHOLD))
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def planning_cores() -> int:
    """CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _helper(plan_one: Callable[[int], Any], positions: list[int], path: str) -> None:
    """The forked helper: plan ``positions``, write the result to ``path``, exit at once
    (never returning into the parent's code, whatever happens)."""
    try:
        try:
            payload: tuple[str, Any] = ("ok", [plan_one(p) for p in positions])
        except BaseException as error:  # noqa: BLE001 (reported to the parent, which replans)
            payload = ("error", f"{type(error).__name__}: {error}")
        with open(path, "wb") as handle:
            pickle.dump(payload, handle)
    finally:
        os._exit(0)


def _wait(pid: int, limit_s: float) -> bool:
    """Wait for the helper up to ``limit_s``; kill it past that. True when it exited."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return True
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


def _collect(pid: int, path: str, limit_s: float) -> list[Any] | None:
    """The helper's plans, or None (logged) when it did not deliver them."""
    try:
        if not _wait(pid, limit_s):
            log.warning("zeroc: the planning helper took over %.0f s; planning its positions "
                        "here", limit_s)
            return None
        with open(path, "rb") as handle:
            status, value = pickle.load(handle)
    except (OSError, EOFError, pickle.UnpicklingError) as error:
        log.warning("zeroc: the planning helper gave no result (%s); planning its positions "
                    "here", error)
        return None
    finally:
        os.unlink(path)
    if status != "ok":
        log.info("zeroc: the planning helper failed (%s); planning its positions here", value)
        return None
    return value


def plan_positions(plan_one: Callable[[int], Any], positions: list[int],
                   work: dict[int, PositionWork] | None = None) -> list[Any]:
    """``[plan_one(p) for p in positions]``; with two cores and at least two positions, some
    planned by a forked helper while this process plans the others (``split_positions``
    divides them by ``work``; see the module docstring)."""
    if len(positions) < 2 or planning_cores() < 2 or not hasattr(os, "fork"):
        return [plan_one(p) for p in positions]
    theirs, mine = split_positions(positions, work)
    handle, path = tempfile.mkstemp(prefix="zeroc-plan-", suffix=".pkl")
    os.close(handle)
    log.info("zeroc: planning positions %s in a helper process, %s here", theirs, mine)
    pid = os.fork()
    if pid == 0:
        _helper(plan_one, theirs, path)
    started = time.perf_counter()
    try:
        own = [plan_one(p) for p in mine]
    except BaseException:
        _wait(pid, 0.0)  # this process's error wins: the helper is stopped and reaped
        os.unlink(path)
        raise
    elapsed = time.perf_counter() - started
    helped = _collect(pid, path, max(_MIN_WAIT_S, _WAIT_FACTOR * elapsed))
    if helped is None or len(helped) != len(theirs):
        helped = [plan_one(p) for p in theirs]
    planned = dict(zip(theirs, helped, strict=True)) | dict(zip(mine, own, strict=True))
    return [planned[p] for p in positions]
