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
    """The built wheel contains every module of zeroc and of its subpackages."""
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
        assert "zeroc = zeroc.frontend.backend:zeroc_backend" in wheel.read(entry_points).decode()
    # every source file of every subpackage, and the hardware profiles' data
    expected = {"zeroc/runtime/cost/hardware_profiles.json"}
    for folder, package in (("compiler", "zeroc"), ("passes", "zeroc/passes"),
                            ("codegen", "zeroc/codegen"), ("runtime", "zeroc/runtime")):
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            relative = os.path.relpath(root, os.path.join(REPO, folder)).replace(os.sep, "/")
            expected |= {f"{package}/{relative}/{f}".replace("/./", "/")
                         for f in files if f.endswith(".py")}
    assert len(expected) > 100 and "zeroc/world/fake_world.py" in expected
    assert expected <= names, sorted(expected - names)
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
