"""benchmarks/gpu_check.py: its flags, the MFU fallbacks, the loss rule, and a CPU smoke run."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_check.py")
FLAGS = ("--d-model", "--n-layer", "--n-head", "--seq", "--vocab", "--batch", "--steps",
         "--warmup", "--repeats", "--dtype", "--zero3-precision", "--configs", "--batches",
         "--lr", "--hardware", "--time-budget-s", "--cache-dir", "--json", "--cpu-smoke")


@functools.cache
def _load_script():
    """The script as a module (registered first: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("benchmarks_gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run(args: list[str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


@pytest.mark.timeout(120)
def test_help_documents_every_flag(tmp_path: str) -> None:
    """--help exits 0 and names every flag and how to run the check."""
    result = _run(["--help"], str(tmp_path), 100)
    assert result.returncode == 0, result.stderr[-3000:]
    for flag in FLAGS:
        assert flag in result.stdout, flag
    assert "--json $OUT/gpu_check.json" in " ".join(result.stdout.split())


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a CUDA device")
def test_without_cuda_exits_2_at_once(tmp_path: str) -> None:
    """Without CUDA and without --cpu-smoke it says so and exits with status 2."""
    path = os.path.join(str(tmp_path), "out.json")
    result = _run(["--json", path], str(tmp_path), 100)
    assert result.returncode == 2, result.stdout + result.stderr[-3000:]
    assert "no CUDA device" in result.stderr and "--cpu-smoke" in result.stderr
    with open(path) as handle:
        payload = json.load(handle)
    assert payload["ok"] is False and "no CUDA device" in payload["skipped"]


def test_peak_flops_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A known --hardware gives the peak; an unknown device, a bad name, no device name and a
    missing hardware module each give no peak and a reason, without raising."""
    gpu_check = _load_script()
    if importlib.util.find_spec("zeroc.runtime.hardware") is not None:
        from zeroc.runtime.hardware import get_profile

        found = gpu_check.resolve_peak("h200", None, torch.bfloat16)
        assert found["name"] == "h200" and found["reason"] is None
        assert found["peak_flops"] == get_profile("h200").flops_for(torch.bfloat16)
        for hardware, device in ((None, "Some Unknown Accelerator"), ("no-such-gpu", None),
                                 (None, None)):
            found = gpu_check.resolve_peak(hardware, device, torch.bfloat16)
            assert found["peak_flops"] is None and found["reason"], (hardware, device)
    monkeypatch.setitem(sys.modules, "zeroc.runtime.hardware", None)  # import raises
    found = gpu_check.resolve_peak("h200", "NVIDIA H200", torch.bfloat16)
    assert found["peak_flops"] is None
    assert "zeroc.runtime.hardware is not available" in found["reason"]


def test_loss_rule() -> None:
    """Losses agree step by step within rtol * |eager| + atol; NaN or a short run does not."""
    gpu_check = _load_script()
    rtol, atol = gpu_check.TOLERANCE[torch.bfloat16]
    reference = [10.0, 9.0, 8.0]
    close = [v + 0.9 * (rtol * v + atol) for v in reference]
    assert gpu_check.compare_losses(close, reference, torch.bfloat16)["agree"]
    far = [10.0, 9.0, 8.0 + 1.1 * (rtol * 8.0 + atol)]
    assert not gpu_check.compare_losses(far, reference, torch.bfloat16)["agree"]
    assert not gpu_check.compare_losses([10.0, float("nan"), 8.0], reference,
                                        torch.bfloat16)["agree"]
    assert not gpu_check.compare_losses(reference[:2], reference, torch.bfloat16)["agree"]
    assert not gpu_check.compare_losses(reference, None, torch.bfloat16)["agree"]


@pytest.mark.timeout(120)
def test_failing_configuration_is_recorded(tmp_path: str, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    """An exception in one configuration lands in the JSON with its traceback, the others
    still run, and the exit status is 1."""
    gpu_check = _load_script()
    build = gpu_check.build

    def failing_build(config: str, setup):
        if config == "zeroc":
            raise RuntimeError("injected failure")
        return build(config, setup)

    monkeypatch.setattr(gpu_check, "build", failing_build)
    path = os.path.join(str(tmp_path), "out.json")
    threads = torch.get_num_threads()
    try:
        status = gpu_check.main(["--cpu-smoke", "--configs", "zeroc", "--json", path])
    finally:
        torch.set_num_threads(threads)
    assert status == 1
    with open(path) as handle:
        payload = json.load(handle)
    assert payload["ok"] is False
    (failed,) = payload["runs"]["zeroc"]
    assert failed["error"] == "RuntimeError: injected failure"
    assert "failing_build" in failed["traceback"]
    assert payload["results"]["zeroc"]["ran"] is False
    assert payload["results"]["eager"]["ran"] and payload["results"]["eager"]["losses_agree"]


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_cpu_smoke_run(tmp_path: str) -> None:
    """--cpu-smoke trains every configuration, the losses agree with eager's, the JSON has
    every configuration's numbers, and the exit status is 0."""
    path = os.path.join(str(tmp_path), "gpu_check.json")
    result = _run(["--cpu-smoke", "--hardware", "h200", "--json", path], str(tmp_path), 300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "losses agree" in result.stdout
    with open(path) as handle:
        payload = json.load(handle)
    assert payload["ok"] is True
    assert payload["mode"] == "cpu-smoke" and payload["torch"] == torch.__version__
    assert "triton" in payload and payload["repeats_run"] == 1
    assert payload["loss_tolerance"]["rtol"] > 0
    configs = ("eager", "inductor", "zeroc", "zeroc_zero3")
    assert set(payload["results"]) == set(configs) == set(payload["runs"])
    assert payload["process_group"]["backend"] == "gloo"
    assert payload["flops_per_step"]["used"] > 0
    hardware_known = importlib.util.find_spec("zeroc.runtime.hardware") is not None
    eager_losses = payload["runs"]["eager"][0]["losses"]
    assert len(eager_losses) == 1 + payload["warmup"] + payload["steps"]
    for config in configs:
        summary = payload["results"][config]
        assert summary["ran"] and summary["losses_agree"], (config, summary)
        assert summary["step_median_s"] > 0 and summary["tokens_per_s"] > 0
        assert summary["first_step_s_per_repeat"][0] > 0
        assert summary["time_over_eager"] > 0 and summary["time_over_inductor"] > 0
        if hardware_known:
            assert 0 < summary["mfu"]
        (run,) = payload["runs"][config]
        assert run["error"] is None and run["traceback"] is None
        assert len(run["step_s"]) == payload["steps"]
        assert len(run["losses"]) == len(eager_losses)
        rtol, atol = payload["loss_tolerance"]["rtol"], payload["loss_tolerance"]["atol"]
        for ours, theirs in zip(run["losses"], eager_losses, strict=True):
            assert abs(ours - theirs) <= rtol * abs(theirs) + atol, (config, ours, theirs)
