"""``python -m zeroc explain FILE.py:FACTORY --world W ...`` from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "zeroc", "explain", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_help_documents_every_flag() -> None:
    out = _run("--help").stdout
    for flag in ("--world", "--pp", "--zero", "--device", "--hardware", "--schedule",
                 "--microbatches", "--options", "--json", "--trace", "--quiet"):
        assert flag in out, flag


@pytest.mark.slow
def test_plans_a_four_rank_pipeline_from_a_factory(tmp_path) -> None:
    factory = tmp_path / "model.py"
    factory.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
        import torch
        from models.gpt import GPT, GPTConfig

        def build():
            with torch.device("meta"):
                model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2,
                                      d_model=32))
            tokens = torch.zeros(8, 16, dtype=torch.long)
            return model, (tokens, tokens)
    """))
    plan_json = tmp_path / "plan.json"
    done = _run(f"{factory}:build", "--world", "4", "--pp", "2", "--zero", "3",
                "--schedule", "1f1b", "--hardware", "h100-sxm", "--json", str(plan_json),
                "--trace", str(tmp_path / "trace.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world 4, mesh pp=2 x dp=2" in done.stdout
    assert "estimated step on h100-sxm" in done.stdout
    plan = json.loads(plan_json.read_text())
    assert plan["meta"]["world_size"] == 4
    assert sorted(m["rank"] for m in plan["memory"]) == [0, 1, 2, 3]
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"F0@s0", "B0@s1"} <= names and {e["tid"] for e in events} == {0, 1}


def test_bad_factory_and_hardware_are_named(tmp_path) -> None:
    done = _run("nowhere.py:build", "--world", "2")
    assert done.returncode != 0 and "no file 'nowhere.py'" in done.stderr
    factory = tmp_path / "m.py"
    factory.write_text("def build():\n    raise SystemExit('unused')\n")
    done = _run(f"{factory}:missing", "--world", "2")
    assert done.returncode != 0 and "has no function 'missing'" in done.stderr
