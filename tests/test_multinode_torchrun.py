"""Multi-node as users launch it: two torchrun agents on loopback, two nodes of two ranks.

Two ``python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --node-rank 0`` / ``1``
agents meet through c10d rendezvous on ``127.0.0.1`` and run ``tests/scripts/torchrun_train.py``:
the zoo GPT parallelized with ``zero=3, pp=2`` (dp=2 on the 4 ranks), compiled with
``backend="zeroc"`` and 1F1B over 4 micro-batches, two AdamW steps. The script's rank 0 trains
an eager copy on the global batch; its losses and every parameter after the last step must
match within the fp32 parity tolerance, and each rank must see torchrun's multi-node
environment (global rank vs local rank, two nodes).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "torchrun_train.py")
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
WAIT_S = 220
FAILED_GRACE_S = 20  # after one agent failed, how long the other may take to notice
STEPS = 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _agent(node: int, port: int, out: str, log) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "2", "--node-rank", str(node), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"zeroc-multinode-{port}",
               "--max-restarts", "0", "--local-addr", "127.0.0.1", SCRIPT, out,
               "--steps", str(STEPS)]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group, to end it whole


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (its ranks, in sessions of their own), from ``/proc``."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _end(process: subprocess.Popen) -> None:
    """End an agent this test started and the ranks it started, by their ids: SIGTERM to the
    agent's process group (it stops its ranks), then SIGKILL to whatever is left."""
    if process.poll() is not None:
        return
    below = _descendants(process.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(15)
    for pid in below:  # each rank leads its own session: its group holds its children too
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_torchrun_nodes_train_pp2_dp2_zero3_like_eager(tmp_path) -> None:
    port = _free_port()
    out = str(tmp_path / "result.json")
    logs = [open(tmp_path / f"node{node}.log", "w+") for node in range(2)]  # noqa: SIM115
    agents = []
    try:
        agents = [_agent(node, port, out, logs[node]) for node in range(2)]
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and any(a.poll() is None for a in agents):
            if any(a.poll() not in (None, 0) for a in agents):  # one failed: the other
                deadline = min(deadline, time.monotonic() + FAILED_GRACE_S)  # may hang
            time.sleep(0.5)
    finally:
        for agent in agents:
            _end(agent)
        text = []
        for node, log in enumerate(logs):
            log.seek(0)
            text.append(f"--- node {node} ---\n{log.read()[-4000:]}")
            log.close()
    codes = [agent.returncode for agent in agents]
    assert codes == [0, 0], f"agents exited {codes}\n" + "\n".join(text)

    with open(out) as handle:
        result = json.load(handle)
    assert (result["world"], result["dp"], result["pp"]) == (4, 2, 2)
    assert result["zeroc_losses"] == pytest.approx(result["eager_losses"], rel=1e-5)
    bad = {k: v for k, v in result["param_diffs"].items() if not v["ok"]}
    assert result["params_ok"] and not bad, bad
    assert result["max_param_diff"] < 1e-4

    # torchrun's multi-node environment: global ranks 0-3, local ranks 0-1 on each node,
    # node 0 holding ranks 0-1; dp_index and the pipeline position follow the global rank.
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert [r["group_rank"] for r in ranks] == [0, 0, 1, 1]
    assert {r["local_world_size"] for r in ranks} == {2}
    assert sorted((r["pp_index"], r["dp_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0),
                                                                    (1, 1)]
