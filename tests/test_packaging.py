"""The package installs as laid out: entry-point registration and wheel contents."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(240)
def test_backend_works_without_import_zeroc() -> None:
    """A fresh interpreter finds backend="zeroc" through the entry point alone."""
    code = textwrap.dedent("""
        import sys, torch
        f = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="zeroc")
        x = torch.randn(4)
        torch.testing.assert_close(f(x), torch.sin(x) * 2 + 1)
        import torch._dynamo.backends.registry as registry
        assert "zeroc" in registry.list_backends(exclude_tags=()), registry.list_backends()
        print("ok", "zeroc" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=220, cwd=os.path.expanduser("~"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[0] == "ok"


@pytest.mark.timeout(300)
def test_wheel_holds_every_subpackage(tmp_path: str) -> None:
    """The built wheel contains zeroc and its passes, codegen and runtime subpackages."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), REPO],
        capture_output=True, text=True, timeout=280,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    wheels = [f for f in os.listdir(tmp_path) if f.endswith(".whl")]
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(os.path.join(tmp_path, wheels[0])) as wheel:
        names = set(wheel.namelist())
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "zeroc = zeroc.backend:zeroc_backend" in wheel.read(entry_points).decode()
    for package in ("zeroc", "zeroc/passes", "zeroc/codegen", "zeroc/runtime"):
        assert f"{package}/__init__.py" in names, sorted(names)
    for module in ("zeroc/backend.py", "zeroc/passes/fusion.py", "zeroc/runtime/plan.py"):
        assert module in names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
