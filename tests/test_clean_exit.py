"""A clean exit: no destroyed process group may run into interpreter teardown.

A gloo group lives (with its threads) as long as a Python object references it, even after
``torch.distributed.destroy_process_group()``; one that survives into interpreter teardown
can abort the process (``terminate called without an active exception``). Holders: zeroc's
mesh cache, the ``DeviceMesh`` of the parameters' DTensors (its ``_pg_registry``), and
``torch.distributed.nn`` functions whose ``group=group.WORLD`` default was evaluated when
``torch.compile`` imported them after the user's init. See ``zeroc.runtime.shutdown`` and
``benchmarks/exit_stress.py``.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import types
import weakref

import pytest
import torch
import torch.distributed as dist
from models.gpt import GPT, GPTConfig

import zeroc
from zeroc.runtime import mesh, shutdown

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


def _gloo_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            continue
    return [n for n in names if n in GLOO_THREADS]


def _gloo_threads_settle(expected: int, seconds: float = 10.0) -> int:
    """The number of gloo threads once it reaches ``expected`` or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    count = len(_gloo_threads())
    while count != expected and time.monotonic() < deadline:
        time.sleep(0.05)
        count = len(_gloo_threads())
    return count


def _capturing_module(name: str) -> types.ModuleType:
    """A ``torch.distributed`` module imported after init: a default argument holds WORLD."""
    module = types.ModuleType(name)
    exec("import torch.distributed as dist\n"
         "def all_reduce(tensor, group=dist.group.WORLD):\n"
         "    return dist.all_reduce(tensor, group=group)\n"
         "class Reducer:\n"
         "    def __init__(self, *, group=dist.group.WORLD):\n"
         "        self.group = group\n", module.__dict__)
    return module


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
@pytest.mark.timeout(300)
def test_destroyed_group_is_freed_before_teardown_after_a_compiled_zero_step() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    before = len(_gloo_threads())
    name = "torch.distributed._zeroc_test_capture"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig.tiny())
        zeroc.parallelize(model, zero=3)  # caches the mesh of the default group
        assert mesh._MESH_CACHE
        # What torch.compile does when it first imports torch._dynamo after init.
        sys.modules[name] = captured = _capturing_module(name)
        compiled = torch.compile(model, backend="zeroc")
        tokens = torch.randint(0, 64, (2, 17))
        loss = compiled(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        loss.backward()
        # The backend dropped the captured group; None is the default group everywhere.
        assert captured.all_reduce.__defaults__ == (None,)
        assert captured.Reducer.__init__.__kwdefaults__ == {"group": None}
        assert torch.distributed.nn.functional.all_reduce.__defaults__[-1] is None
        groups = [weakref.ref(g) for g in dist.distributed_c10d._world.pg_map]
        assert len(_gloo_threads()) > before
    finally:
        sys.modules.pop(name, None)
        dist.destroy_process_group()
    # The model (its DTensors' DeviceMesh) still holds the groups; zeroc's exit handler
    # releases them while the interpreter is whole, without the model being freed.
    shutdown.release_destroyed_groups()
    alive = [g() for g in groups if g() is not None]
    assert not alive, (
        f"{len(alive)} destroyed groups still referenced "
        f"({[sys.getrefcount(g) - 1 for g in alive]} references): their gloo threads would "
        "run into interpreter teardown")
    del alive
    # As the exit handler does, collect cycles (a finished collective's work object in one
    # still holds the group's gloo context), then allow gloo's threads a moment to end; a
    # leaked group's threads never end.
    gc.collect()
    assert _gloo_threads_settle(before) == before
    assert not mesh._MESH_CACHE
    assert model is not None


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_training_script_exits_clean_with_nothing_alive(stage: int) -> None:
    """2 torchrun ranks train, destroy the group and exit 0; at exit no group or thread left."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", os.path.join(REPO, "benchmarks", "exit_stress.py"),
               "--worker", "--stage", str(stage), "--steps", "2", "--inspect"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=540, check=False,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    reports = [part for part in output.split("exit_stress: ") if "alive at exit" in part]
    assert len(reports) == 2, output[-4000:]
    for report in reports:
        assert "groups freed" in report, report
        assert "unwaited works 0" in report, report
        assert not any(thread in report for thread in GLOO_THREADS), report
