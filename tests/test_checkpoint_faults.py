"""Checkpoints survive repeated faults (``zeroc.save_checkpoint`` killed at any step).

A save is killed at each step of its protocol, twice in succession (save 2 at step k, then
save 3 at every step j), at the same step again and again, and at random steps; after every
kill ``load_checkpoint`` must return exactly the newest complete checkpoint (every value of
the state holds its step number), and the next save that runs to its end must leave only
``path``.

The steps are found without knowing the protocol: inside ``zeroc.sharding.checkpoint`` every
call that changes the file system (``os.rename``, ``os.replace``, ``os.unlink``,
``os.makedirs``, ``shutil.rmtree``, ``open`` for writing, ``dcp.save``) and DCP's own
``write_data`` and ``finish`` are wrapped to note a step before and after it (and, for
``rmtree``, once it has removed one file), and the k-th step raises ``Killed``. A save's
checkpoint counts as complete once, after its ``dcp.save`` returned, its marker
(``<dir>/COMPLETE``) is renamed into place or its directory is renamed to ``path`` (the
commit of a protocol without a marker), or when the save returns. ``os.fsync`` does nothing
meanwhile: a killed process loses nothing the kernel holds (what a power loss would lose is
not tested here). A save is deterministic given the files it finds, so a kill that leaves
the files as a kill at an earlier step left them is not followed again. One case kills a
real process with SIGKILL at a step.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from zeroc.sharding import checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MARKER = getattr(checkpoint, "MARKER", "COMPLETE")


class Killed(BaseException):
    """A simulated kill: a BaseException, so that no ``except Exception`` in a save stops it."""


class Faults:
    """Notes the steps a save takes; at the step ``kill_at`` picks (its index, or the first
    name it accepts) it kills the save."""

    def __init__(self, target: str, kill_at: int | Callable[[str], bool] | None = None,
                 kill: Callable[[str], None] | None = None) -> None:
        self.target, self.base = target, os.path.dirname(target)
        self.kill_at, self.kill, self.points = kill_at, kill or self._raise, []
        self.fired: str | None = None
        self.written = False  # the save's dcp.save returned
        self.committed = False  # and then its checkpoint was put where it loads from

    def commits(self, name: str, args: tuple) -> bool:
        if name == "dcp.save":
            self.written = True
        return self.written and name in ("rename", "replace") and (
            os.path.basename(args[1]) == MARKER or args[1] == self.target)

    @staticmethod
    def _raise(point: str) -> None:
        raise Killed(point)

    def name(self, value: object) -> str:
        if isinstance(value, (str, os.PathLike)) and os.path.isabs(value):
            return os.path.relpath(os.fspath(value), self.base)
        return repr(value) if isinstance(value, str) else type(value).__name__

    def point(self, point: str) -> None:
        self.points.append(point)
        due = (self.kill_at(point) if callable(self.kill_at)
               else len(self.points) - 1 == self.kill_at)
        if due and self.fired is None:
            self.fired = point
            self.kill(point)


class _Proxy:
    """A module (``os``, ``shutil``, ``dcp``) with some of its functions wrapped."""

    def __init__(self, module: object, **wrapped: Callable) -> None:
        self._module, self._wrapped = module, wrapped

    def __getattr__(self, name: str) -> object:
        return self._wrapped.get(name) or getattr(self._module, name)


def _step(faults: Faults, name: str, function: Callable) -> Callable:
    def wrapped(*args, **kwargs):
        shown = [*args, *(v for v in kwargs.values() if isinstance(v, (str, os.PathLike)))]
        label = f"{name}({', '.join(faults.name(a) for a in shown)})"
        faults.point(f"before {label}")
        result = function(*args, **kwargs)
        if faults.commits(name, args):
            faults.committed = True
        faults.point(f"after {label}")
        return result

    return wrapped


def _rmtree(faults: Faults) -> Callable:
    def rmtree(path, *args, **kwargs):
        label = f"rmtree({faults.name(path)})"
        faults.point(f"before {label}")
        files = sorted(os.path.join(root, f) for root, _, names in os.walk(path)
                       for f in names if f != MARKER)
        if files:  # the worst cut: a data file gone, DCP's .metadata and any marker kept
            os.unlink(files[-1])
        faults.point(f"partway {label}")
        shutil.rmtree(path, *args, **kwargs)
        faults.point(f"after {label}")

    return rmtree


def _open(faults: Faults) -> Callable:
    def opened(file, mode="r", *args, **kwargs):
        if not any(c in mode for c in "wax+"):
            return open(file, mode, *args, **kwargs)
        return _step(faults, "open", open)(file, mode, *args, **kwargs)

    return opened


@contextmanager
def _injected(faults: Faults) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "fsync", lambda fd: None)  # durability is not what is tested here
        patch.setattr(checkpoint, "os", _Proxy(
            os, **{n: _step(faults, n, getattr(os, n))
                   for n in ("rename", "replace", "unlink", "remove", "rmdir", "mkdir",
                             "makedirs")}))
        patch.setattr(checkpoint, "shutil", _Proxy(shutil, rmtree=_rmtree(faults)))
        patch.setattr(checkpoint, "open", _open(faults), raising=False)
        dcp = checkpoint.dcp
        patch.setattr(checkpoint, "dcp", _Proxy(dcp, save=_step(faults, "dcp.save", dcp.save)))
        for method in ("write_data", "finish"):
            original = getattr(FileSystemWriter, method)
            patch.setattr(FileSystemWriter, method, lambda self, *a, _o=original, _m=method,
                          **k: _step(faults, f"dcp.{_m}", lambda: _o(self, *a, **k))())
        yield


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((8,), float(step)), "b": torch.full((3, 2), -step)},
            "step": step}


def _save(directory: str, step: int, kill_at=None, kill=None) -> Faults:
    """Save step ``step``; return the steps it took, ``fired`` naming the one it was killed at
    and ``committed`` telling whether its checkpoint is complete."""
    faults = Faults(directory, kill_at, kill)
    with _injected(faults):
        try:
            checkpoint.save_checkpoint(_state(step), directory)
        except BaseException:
            if faults.fired is None:
                raise
            return faults
    assert faults.fired is None, f"killed at {faults.fired!r}, the save went on"
    faults.committed = True
    return faults


def _loaded_step(directory: str) -> int:
    """The step of what loads; fails unless every value holds that one step."""
    state = {"model": {"w": torch.zeros(8), "b": torch.zeros(3, 2)}, "step": -1}
    checkpoint.load_checkpoint(state, directory)
    step = state["step"]
    assert torch.equal(state["model"]["w"], torch.full((8,), float(step))), state
    assert torch.equal(state["model"]["b"], torch.full((3, 2), -step)), state
    return step


def _check(directory: str, expected: int, what: str, failures: list[str]) -> None:
    try:
        step = _loaded_step(directory)
    except BaseException as error:  # noqa: BLE001 - every failure is reported at the end
        failures.append(f"{what}: load raised {type(error).__name__}: {error}")
        return
    if step != expected:
        failures.append(f"{what}: loaded step {step}, the newest complete is {expected}")


def _finish_and_check(directory: str, step: int, what: str, failures: list[str]) -> None:
    """A save that runs to its end after the kills puts step ``step`` alone at ``directory``."""
    try:
        _save(directory, step)
    except BaseException as error:  # noqa: BLE001
        failures.append(f"{what}, then a whole save: it raised {type(error).__name__}: {error}")
        return
    _check(directory, step, f"{what}, then a whole save", failures)
    left = sorted(set(os.listdir(os.path.dirname(directory))) - {"ckpt"})
    if left:
        failures.append(f"{what}, then a whole save: left {left} beside the checkpoint")


def _report(failures: list[str], runs: int) -> None:
    assert not failures, f"{len(failures)} of {runs} checks failed:\n" + "\n".join(failures[:25])


def _files(run: str) -> tuple:
    """What a save's outcome depends on: every directory and file under ``run`` and what the
    files hold (but DCP's ``.metadata``, which differs in a save id only, by its size)."""
    def content(path: str, name: str) -> object:
        if name == ".metadata":
            return os.path.getsize(path)
        with open(path, "rb") as file:
            return file.read()

    return tuple(sorted(
        (os.path.relpath(os.path.join(root, name), run),
         content(os.path.join(root, name), name) if name in files else None)
        for root, dirs, files in os.walk(run) for name in (*dirs, *files)))


def _reset(run: str, snapshot: str | None = None) -> None:
    shutil.rmtree(run, ignore_errors=True)
    if snapshot is None:
        os.makedirs(run)
    else:
        shutil.copytree(snapshot, run)


def test_two_kills_in_a_row_at_every_pair_of_steps(tmp_path) -> None:
    run, directory = str(tmp_path / "run"), str(tmp_path / "run" / "ckpt")
    failures: list[str] = []
    pairs, first_states, second_states = 0, set(), set()
    k = 0
    while True:
        _reset(run)
        _save(directory, 1)
        second = _save(directory, 2, kill_at=k)
        if second.fired is None:
            break  # save 2 took fewer than k + 1 steps: all of them were killed at
        newest = 2 if second.committed else 1
        first_kill = f"save 2 killed {second.fired!r} (step {k})"
        _check(directory, newest, first_kill, failures)
        state = (_files(run), newest)
        if state in first_states:  # as a kill at an earlier step left it: the same follows
            k += 1
            continue
        first_states.add(state)
        snapshot = str(tmp_path / f"after_kill_{k}")
        shutil.copytree(run, snapshot)
        j = 0
        while True:
            _reset(run, snapshot)
            third = _save(directory, 3, kill_at=j)
            if third.fired is None:
                _check(directory, 3, f"{first_kill}, save 3 whole", failures)
                if sorted(os.listdir(run)) != ["ckpt"]:
                    failures.append(f"{first_kill}, save 3 whole: left {os.listdir(run)}")
                break
            pairs += 1
            what = f"{first_kill}, save 3 killed {third.fired!r} (step {j})"
            _check(directory, 3 if third.committed else newest, what, failures)
            state = _files(run)
            if state not in second_states:
                second_states.add(state)
                _finish_and_check(directory, 4, what, failures)
            j += 1
        shutil.rmtree(snapshot)
        k += 1
    assert k >= 10, f"a save took only {k} steps: the faults are not injected ({second.points})"
    _report(failures, pairs)


def test_the_same_step_killed_again_and_again(tmp_path) -> None:
    run, directory = str(tmp_path / "run"), str(tmp_path / "run" / "ckpt")
    failures: list[str] = []
    k = 0
    while True:
        _reset(run)
        _save(directory, 1)
        newest, fired = 1, False
        for step in range(2, 6):  # four kills in a row, each at the k-th step of its save
            killed = _save(directory, step, kill_at=k)
            fired = fired or killed.fired is not None
            newest = step if killed.committed else newest
            _check(directory, newest, f"saves 2..{step} killed at their step {k} "
                   f"(the last at {killed.fired!r})", failures)
        if not fired:
            break
        _finish_and_check(directory, 6, f"saves 2..5 killed at their step {k}", failures)
        k += 1
    assert k >= 10, k
    _report(failures, 5 * k)


def test_runs_of_kills_at_random_steps(tmp_path) -> None:
    """Two to six saves in a row, each killed at a random step (or not, past its last)."""
    run, directory = str(tmp_path / "run"), str(tmp_path / "run" / "ckpt")
    failures: list[str] = []
    rng, checks = random.Random(20240607), 0
    for run_number in range(40):
        _reset(run)
        _save(directory, 1)
        newest, kills = 1, []
        for step in range(2, 2 + rng.randint(2, 6)):
            killed = _save(directory, step, kill_at=rng.randrange(34))
            newest = step if killed.committed else newest
            kills.append(killed.fired)
            checks += 1
            _check(directory, newest, f"run {run_number}, kills {kills}", failures)
        _finish_and_check(directory, 99, f"run {run_number}, kills {kills}", failures)
    _report(failures, checks)


def test_the_reported_pair_of_kills_loads_the_complete_checkpoint(tmp_path) -> None:
    """Save 2 killed between its renames, save 3 once it has removed ``.previous``: a complete
    checkpoint is left (save 2's), and it loads (it was a FileNotFoundError)."""
    directory = str(tmp_path / "ckpt")
    _save(directory, 1)
    second = _save(directory, 2, kill_at=lambda p: p == "after rename(ckpt, ckpt.previous)")
    assert second.fired, second.points
    third = _save(directory, 3, kill_at=lambda p: p == "after rmtree(ckpt.previous)")
    assert third.fired, third.points
    assert _loaded_step(directory) == (3 if third.committed else 2)
    _save(directory, 4)
    assert _loaded_step(directory) == 4
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_an_unfinished_first_save_is_no_checkpoint_and_plain_dcp_ones_load(tmp_path) -> None:
    directory = str(tmp_path / "ckpt")
    killed = _save(directory, 1, kill_at=lambda p: p.startswith("after dcp.write_data"))
    assert killed.fired and not killed.committed
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint at .*ckpt: none of "
                       r".*ckpt\.partial holds a COMPLETE marker"):
        checkpoint.load_checkpoint(_state(0), directory)
    shutil.rmtree(tmp_path / "ckpt.partial")
    checkpoint.dcp.save(_state(7), checkpoint_id=directory)  # no marker: plain DCP, or older
    assert _loaded_step(directory) == 7
    _save(directory, 8, kill_at=lambda p: p.startswith("after dcp.save"))
    assert _loaded_step(directory) == 7  # written, not committed: the plain one is newest
    _save(directory, 9)
    assert _loaded_step(directory) == 9
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def _killed_child(directory: str, step: int, point: str) -> None:
    """In a child process: save ``step``, SIGKILLed at ``point``."""
    _save(directory, step, kill_at=lambda p: p == point,
          kill=lambda p: os.kill(os.getpid(), signal.SIGKILL))
    sys.exit(f"the save of step {step} went past {point!r} without being killed")


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
@pytest.mark.timeout(120)
def test_a_save_killed_by_sigkill_after_a_killed_save(tmp_path) -> None:
    directory = str(tmp_path / "ckpt")
    _save(directory, 1)
    second = _save(directory, 2, kill_at=lambda p: p == "after rename(ckpt, ckpt.previous)")
    assert second.fired, second.points
    code = ("import sys, warnings; warnings.simplefilter('ignore'); "
            "sys.path.insert(0, sys.argv[1]); import test_checkpoint_faults as t; "
            "t._killed_child(sys.argv[2], 3, sys.argv[3])")
    tests = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.run(
        [sys.executable, "-c", code, tests, directory, "after rmtree(ckpt.previous)"],
        capture_output=True, text=True, timeout=100, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.returncode == -signal.SIGKILL, (child.returncode, child.stderr[-3000:])
    assert _loaded_step(directory) == (2 if second.committed else 1)  # save 3's is not
    _save(directory, 4)
    assert _loaded_step(directory) == 4
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
