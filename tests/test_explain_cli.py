"""``python -m zeroc explain FILE.py:FACTORY --world W ...`` from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str, timeout: float = 300, cwd: str = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "zeroc", "explain", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


SMALL_FACTORY = """
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum()


def build():
    return Net(), (torch.randn(4, 8),)
"""


def _plant(directory, name: str, marker) -> None:
    """A module ``name`` in ``directory`` that leaves ``marker`` behind if it is imported."""
    (directory / f"{name}.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n"
        f"raise ImportError('the planted {name} ran')\n")


def test_modules_beside_the_factory_or_in_the_cwd_do_not_replace_dependencies(
        tmp_path) -> None:
    """Only the named file runs: ``filelock`` (imported by torch while zeroc plans, after the
    factory loaded) planted beside the factory and ``networkx`` planted in the current
    directory are not imported in place of the installed packages."""
    beside, cwd = tmp_path / "factory_dir", tmp_path / "cwd"
    beside.mkdir()
    cwd.mkdir()
    (beside / "small.py").write_text(SMALL_FACTORY)
    (beside / "helper.py").write_text("ROWS = 4\n")  # the factory's own sibling: importable
    (beside / "small.py").write_text(SMALL_FACTORY.replace(
        "import torch\n", "import torch\nfrom helper import ROWS\n", 1))
    _plant(beside, "filelock", tmp_path / "filelock_ran")
    _plant(cwd, "networkx", tmp_path / "networkx_ran")
    done = _run(f"{beside / 'small.py'}:build", "--world", "2", "--quiet", cwd=str(cwd))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world 2" in done.stdout
    assert not (tmp_path / "filelock_ran").exists() and not (tmp_path / "networkx_ran").exists()


def test_a_factory_file_named_like_an_installed_module_is_refused(tmp_path) -> None:
    (tmp_path / "tabulate.py").write_text(SMALL_FACTORY)
    done = _run(f"{tmp_path / 'tabulate.py'}:build", "--world", "2", "--quiet")
    assert done.returncode != 0
    assert "module name 'tabulate' is also" in done.stderr and "rename" in done.stderr


def test_the_tune_planning_child_puts_the_current_directory_last(tmp_path,
                                                                 monkeypatch) -> None:
    """The planning child of ``zeroc.tune`` runs isolated with this process's path, the
    current directory last: a ``typing_extensions.py`` there (torch imports it) is not run."""
    from zeroc.tuning.tune_estimate import child_command

    _plant(tmp_path, "typing_extensions", tmp_path / "planted_ran")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", *sys.path])  # as under python -c or python -m
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    code = ("import sys, typing_extensions, zeroc; print(typing_extensions.__file__); "
            "print(sys.path[-1]); print(sys.argv[1:])")
    done = subprocess.run(child_command(code, "in.pkl", "out.pkl"), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found, last, args = done.stdout.splitlines()
    assert not found.startswith(str(tmp_path)) and not (tmp_path / "planted_ran").exists()
    assert last == str(tmp_path) and args == "['in.pkl', 'out.pkl']"


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
                model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2,
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
