"""Plan a world's pipeline positions on two CPU cores: half of them in a forked helper.

``zeroc.explain(model, inputs, world=W, pp=P)`` plans each of the ``P`` positions with one
fake training step (``zeroc.fake_world.plan_position``). What every position shares (Dynamo's
trace and the pipeline front: ``zeroc.plan_capture``, ``zeroc.pipeline_front``) is built
first, in this process (``zeroc.fake_world.share_front``); after it the positions are
independent: each makes its own fake process group, parallelizes its own copy of the model,
compiles the stages it runs and runs its own step. With two or more cores at hand
``plan_positions`` forks one helper process, which inherits everything built so far and
plans the first half of the positions while this process plans the second half; the helper
sends its ``PositionPlan`` objects back pickled through a file and exits without running
anything else of this process. Each half compiles one end of the pipeline (the first
stage's program or the last's) and the middle stages' shared program once.

Nothing depends on the helper: if it fails, is killed or takes far longer than this process
took for its own half, this process plans its positions itself (a genuine error then
surfaces here, with its traceback). Planning is the same either way (tested): the helper
runs the same code on the same inherited state.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import tempfile
import time
from collections.abc import Callable
from typing import Any

__all__ = ["plan_positions", "planning_cores"]

log = logging.getLogger(__name__)

# The helper may take this many times as long as this process's own half (and at least
# ``_MIN_WAIT_S``) before it is given up on.
_WAIT_FACTOR = 4.0
_MIN_WAIT_S = 120.0


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


def plan_positions(plan_one: Callable[[int], Any], positions: list[int]) -> list[Any]:
    """``[plan_one(p) for p in positions]``; with two cores and at least two positions, the
    first half planned by a forked helper while this process plans the second half (see the
    module docstring)."""
    if len(positions) < 2 or planning_cores() < 2 or not hasattr(os, "fork"):
        return [plan_one(p) for p in positions]
    half = (len(positions) + 1) // 2
    theirs, mine = positions[:half], positions[half:]
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
    return helped + own
