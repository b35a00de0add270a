"""Where the demo and the tuner run: ``--help``, ``--device``, torchrun's world, Ctrl-C, failures.

The fast cases check the flags, the device choice (``zeroc.cli.local_ranks.resolve_device``, with
the GPU count faked for the CUDA cases) and the torchrun environment in this process. The slow
ones start real ranks: ``torchrun --nproc-per-node 2 -m zeroc demo`` (via
``python -m torch.distributed.run``), Ctrl-C sent to a 2-rank demo once its first line is
out, a rank that raises, and ``python -m zeroc tune --nproc 2``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from test_tune import FACTORY  # the tiny factory the tune CLI tests share

from zeroc.cli import local_ranks
from zeroc.cli.demo import build_parser, parse_args, run_demo
from zeroc.cli.local_ranks import in_torchrun, resolve_device, run_local_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--steps", "1", "--layers", "1", "--width", "32", "--seq", "16", "--batch", "2"]
FLAGS = ("--steps", "--batch", "--seq", "--layers", "--width", "--lr", "--seed", "--nproc",
         "--device", "--zero", "--pp", "--schedule", "--microbatches")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


@pytest.fixture
def no_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_help_lists_every_flag_with_its_help(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as done:
        run_demo(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    options = [o for a in build_parser()._actions for o in a.option_strings
               if o not in ("-h", "--help")]
    assert set(FLAGS) <= set(options)
    for action in build_parser()._actions:
        assert action.help, action.option_strings  # no flag without a line of help
    for flag in options:
        assert re.search(rf"^\s+{flag}\b", text, re.M), flag


def test_device_cuda_without_a_gpu_is_a_clear_error(capsys: pytest.CaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    no_torchrun: None) -> None:
    _fake_gpus(monkeypatch, 0)
    with pytest.raises(SystemExit) as done:
        run_demo(["--device", "cuda", *TINY])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda: no CUDA GPU is available here" in err and "--device cpu" in err
    assert parse_args(TINY).device == "cpu"  # auto without a GPU


def test_auto_uses_cuda_only_with_a_gpu_per_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, 2)
    assert resolve_device("auto", 2) == resolve_device(None, 1) == "cuda"
    assert resolve_device("auto", 4) == "cpu" and resolve_device("cpu", 2) == "cpu"
    with pytest.raises(ValueError, match="needs a GPU per rank, but it has 2"):
        resolve_device("cuda", 4)
    with pytest.raises(ValueError, match=r"--device 'tpu' is not allowed.*'auto', 'cpu', "):
        resolve_device("tpu")
    assert local_ranks.backend_for("cuda") == "nccl" and local_ranks.backend_for("cpu") == "gloo"


def test_under_torchrun_the_world_is_torchruns(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not in_torchrun()  # LOCAL_RANK missing: not a torchrun rank
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert in_torchrun()
    args = parse_args(TINY)
    assert (args.nproc, args.zero, args.device) == (2, 3, "cpu")
    with pytest.raises(SystemExit):
        parse_args(["--nproc", "4", *TINY])
    assert "--nproc 4 does not match torchrun's WORLD_SIZE 2" in capsys.readouterr().err


def test_nccl_ranks_bind_their_group_to_their_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA every launcher passes ``device_id=cuda:LOCAL_RANK`` to ``init_process_group``
    (torchrun's ranks and the local ones alike); gloo on the CPU gets none."""
    calls: list[tuple[tuple, dict]] = []
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 3)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 4)
    _fake_gpus(monkeypatch, 2)
    for name, value in (("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"),
                        ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    assert local_ranks.init_from_torchrun("cuda") == (3, 4)
    assert calls[-1] == (("nccl",), {"device_id": torch.device("cuda", 1)})
    local_ranks.init_from_torchrun("cpu")
    assert calls[-1] == (("gloo",), {})
    from zeroc.cli import _rank_processes

    store = object()
    _rank_processes.init_group("cuda", 1, store=store, rank=1, world_size=2)
    assert calls[-1] == (("nccl",), {"store": store, "rank": 1, "world_size": 2,
                                     "device_id": torch.device("cuda", 1)})
    _rank_processes.init_group("cpu", 1, store=store, rank=1, world_size=2)
    assert calls[-1] == (("gloo",), {"store": store, "rank": 1, "world_size": 2})


def _fail_on_rank_1(rank: int, world: int, message: str) -> int:
    if rank == 1:
        raise RuntimeError(message)
    return 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_failing_rank_is_one_line_naming_it(capsys: pytest.CaptureFixture) -> None:
    code = run_local_ranks(_fail_on_rank_1, 2, "rank 1 broke", device="cpu", name="zeroc test")
    err = capsys.readouterr().err
    assert code == 1
    lines = [line for line in err.splitlines() if line.startswith("zeroc test:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "rank 1 failed: RuntimeError: rank 1 broke" in lines[0]
    path = re.search(r"traceback in (\S+)\)", lines[0]).group(1)
    with open(path) as handle:
        assert "_fail_on_rank_1" in handle.read()
    os.unlink(path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_runs_one_demo_on_its_world() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "zeroc",
         "demo", *TINY], capture_output=True, text=True, timeout=280, cwd=ROOT, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.count("zeroc demo: GPT") == 1 and out.count("zeroc plan ") == 1, out
    assert "on cpu, 2 gloo ranks, zero 3, pp 1" in out
    assert len(re.findall(r"^\s+0\s+\d+\.\d+\s+\d+\.\d+", out, re.M)) == 1  # step 0, once
    assert "world 2" in out


def _interrupt(process: subprocess.Popen, send: Any) -> str:
    """``send()`` the interrupt, wait for ``process`` (killing it if it hangs); its stderr."""
    try:
        send()
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_stops_every_rank_with_one_line() -> None:
    """SIGINT to the parent and its ranks, as a terminal's Ctrl-C. (SIGINT to the parent
    alone takes the same path: the parent stops the ranks itself.)"""
    process = subprocess.Popen(
        [sys.executable, "-m", "zeroc", "demo", "--nproc", "2", *TINY, "--steps", "1000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env(),
        start_new_session=True)
    first = process.stdout.readline()  # rank 0 is up: the ranks are running
    assert first.startswith("zeroc demo: GPT"), first
    err = _interrupt(process, lambda: os.killpg(process.pid, signal.SIGINT))
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert [line for line in err.splitlines() if "interrupted" in line] == [
        "zeroc demo: interrupted; stopped 2 ranks"], err[-3000:]


def test_ctrl_c_while_python_imports_zeroc_is_one_line() -> None:
    """``python -m zeroc`` spends its first seconds importing the package (and torch), before
    any command's handler exists: a Ctrl-C then also ends with one line and exit 130."""
    process = subprocess.Popen([sys.executable, "-m", "zeroc", "demo", *TINY],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=ROOT, env=_env())
    time.sleep(0.3)  # importing torch takes seconds: the signal lands inside the import
    err = _interrupt(process, lambda: process.send_signal(signal.SIGINT))
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-3000:]
    assert "interrupted" in err, err[-3000:]




@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tune_cli_measures_on_two_local_ranks(tmp_path) -> None:
    factory = tmp_path / "factory.py"
    factory.write_text(FACTORY)
    out = tmp_path / "tuned.json"
    search = json.dumps({"zero": [2], "fused_loss": [True], "partitioner": ["default"],
                         "pp": [1]})
    done = subprocess.run(
        [sys.executable, "-m", "zeroc", "tune", f"{factory}:build", "--nproc", "2",
         "--hardware", "h100-sxm", "--device", "cpu", "--search", search, "--measure", "1",
         "--steps", "1", "--cache-dir", str(tmp_path / "cache"), "--json", str(out)],
        capture_output=True, text=True, timeout=280, cwd=ROOT, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("chosen: zero2 pp1") == 1, done.stdout
    saved = json.loads(out.read_text())
    assert saved["measured"] is True and saved["trials"][0]["measured_s"] > 0
