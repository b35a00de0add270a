"""benchmarks/gpu_kernels.py (and its step part, benchmarks/gpu_step.py): the bandwidth and
ratio arithmetic, the HBM fallbacks, the budget, the no-CUDA skip and a CPU smoke run."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import math
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_kernels.py")


@functools.cache
def _load_script():
    """The script as a module (it imports benchmarks/gpu_step.py as ``gpu_step``)."""
    spec = importlib.util.spec_from_file_location("benchmarks_gpu_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _main(argv: list[str]) -> tuple[int, str]:
    """Run the script's main in this process; return its status and what it printed."""
    threads = torch.get_num_threads()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            status = _load_script().main(argv)
    finally:
        torch.set_num_threads(threads)
    return status, out.getvalue()


def test_bandwidth_arithmetic() -> None:
    """Bytes moved count every input and output tensor; GB/s and the HBM fraction follow."""
    gk = _load_script()
    x = torch.empty(1024, 1024, dtype=torch.float32)
    w = torch.empty(1024, dtype=torch.bfloat16)
    assert gk.tensor_bytes(x) == 4 * 2**20
    assert gk.tensor_bytes((x, w), [w], "not a tensor", 3) == 4 * 2**20 + 2 * 2048
    gbps, fraction = gk.bandwidth(4_000_000_000, 1.0, 4.8e12)  # 4 GB in 1 ms
    assert gbps == pytest.approx(4000.0) and fraction == pytest.approx(4000 / 4800)
    gbps, fraction = gk.bandwidth(3_000_000, 0.002, None)  # 3 MB in 2 us, no HBM figure
    assert gbps == pytest.approx(1500.0) and fraction is None
    assert gk.bandwidth(1000, None, 4.8e12) == (None, None)
    assert gk.bandwidth(1000, 0.0, 4.8e12) == (None, None)
    ok = {"pattern": "softmax", "dtype": "bfloat16", "eager_ms": 0.1, "inductor_ms": 0.08,
          "zeroc_ms": 0.05, "zeroc_over_inductor": 0.625, "zeroc_over_eager": 0.5,
          "eager_gbps": 1200.0, "inductor_gbps": 1500.0, "zeroc_gbps": 2400.0,
          "zeroc_hbm_fraction": 0.5, "zeroc_ok": True, "zeroc_err": 1e-3, "error": None}
    failed = {"pattern": "layernorm", "dtype": "float32", "zeroc_ok": False,
              "error": "RuntimeError: boom"}
    _, _, good, bad = gk.format_table([ok, failed]).splitlines()
    assert "2400" in good and "50.0" in good and "n/a" not in good
    assert bad.count("n/a") >= 9 and "RuntimeError: boom" in bad


def test_hbm_from_profile_flag_or_unknown() -> None:
    """A known device name gives its profile's bandwidth; else --hbm-gbps; else unknown."""
    gk = _load_script()
    from zeroc.runtime.cost.hardware import get_profile

    found = gk.resolve_hbm("NVIDIA H200", 1234.0)
    assert found["bytes_per_s"] == get_profile("h200").memory_bytes_per_s == 4.8e12
    assert "h200" in found["source"]
    found = gk.resolve_hbm("Some Unknown Accelerator", 1234.0)
    assert found["bytes_per_s"] == pytest.approx(1234e9) and found["source"] == "--hbm-gbps"
    for name in ("Some Unknown Accelerator", None):
        found = gk.resolve_hbm(name, None)
        assert found["bytes_per_s"] is None and found["source"] == "unknown"
        assert "--hbm-gbps" in found["reason"]


def test_ratios_tokens_and_loss_rule() -> None:
    """Step-time ratios to eager and Inductor, tokens/s, and the final-loss rule; a missing
    time is n/a (None), not an error."""
    step = _load_script().gpu_step
    ratios = step.time_ratios({"eager": 0.2, "inductor": 0.1, "zeroc_triton": 0.08,
                               "zeroc_inductor": None})
    assert ratios["eager"] == {"over_eager": 1.0, "over_inductor": 2.0}
    assert ratios["zeroc_triton"]["over_eager"] == pytest.approx(0.4)
    assert ratios["zeroc_triton"]["over_inductor"] == pytest.approx(0.8)
    assert ratios["zeroc_inductor"] == {"over_eager": None, "over_inductor": None}
    assert step.time_ratios({"eager": 0.2, "zeroc": 0.3})["zeroc"]["over_inductor"] is None
    assert step.tokens_per_s(8 * 1024, 0.1) == pytest.approx(81920.0)
    assert step.tokens_per_s(8 * 1024, None) is None
    rtol, atol = step.LOSS_TOLERANCE[torch.bfloat16]
    assert step.losses_agree(8.0 + 0.9 * (rtol * 8 + atol), 8.0, torch.bfloat16)
    assert not step.losses_agree(8.0 + 1.1 * (rtol * 8 + atol), 8.0, torch.bfloat16)
    assert not step.losses_agree(math.nan, 8.0, torch.bfloat16)
    assert step.losses_agree(None, 8.0, torch.bfloat16) is None


def test_summary_of_runs() -> None:
    """summarize: medians, tokens/s, ratios, a final-loss mismatch and a failed variant."""
    step = _load_script().gpu_step
    cfg = step.GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=32)
    setup = step.StepSetup(cfg, 4, 3, 0, 3e-4, "cpu", torch.bfloat16, "/unused")
    runs = [step.VariantRun("eager", 1.0, [0.3, 0.1, 0.2], [5.0, 4.0]),
            step.VariantRun("inductor", 9.0, [0.1, 0.05, 0.4], [5.0, 4.01]),
            step.VariantRun("zeroc_triton", 3.0, [0.05, 0.06, 0.04], [5.0, 4.5]),
            step.VariantRun("zeroc_inductor", error="RuntimeError: boom")]
    summary = step.summarize(runs, setup)
    eager, inductor = summary["eager"], summary["inductor"]
    assert eager["step_median_s"] == pytest.approx(0.2)
    assert eager["tokens_per_s"] == pytest.approx(64 / 0.2)
    assert inductor["over_eager"] == pytest.approx(0.5) and eager["over_inductor"] == 2.0
    assert eager["loss_agrees"] and inductor["loss_agrees"]
    assert summary["zeroc_triton"]["loss_agrees"] is False
    assert summary["zeroc_triton"]["over_inductor"] == pytest.approx(0.05 / 0.1)
    failed = summary["zeroc_inductor"]
    assert not failed["ran"] and failed["error"] == "RuntimeError: boom"
    assert failed["step_median_s"] is None and failed["tokens_per_s"] is None
    table = step.format_step_table({"variants": summary})
    assert "MISMATCH" in table and "RuntimeError: boom" in table


def test_without_cuda_writes_skipped(tmp_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CUDA (and without --cpu-smoke) it exits 0 and writes only {"skipped": ...}."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = os.path.join(str(tmp_path), "out.json")
    status, _ = _main(["--out", path])
    assert status == 0
    with open(path) as handle:
        payload = json.load(handle)
    assert list(payload) == ["skipped"] and "no CUDA device" in payload["skipped"]


def test_help_names_the_flags_and_the_command() -> None:
    """--help names the budget, bandwidth and smoke flags and the unattended command."""
    gk = _load_script()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        gk.parse_args(["--help"])
    text = " ".join(out.getvalue().split())
    for flag in ("--budget-s", "--hbm-gbps", "--cpu-smoke", "--cpu-inductor", "--variants",
                 "--d-model", "--n-layer", "--seq", "--vocab", "--batch", "--steps"):
        assert flag in text, flag
    assert "--out $OUT/gpu_kernels.json" in text


def test_cpu_smoke_run(tmp_path: str) -> None:
    """--cpu-smoke trains eager and zeroc in bf16 autocast; both have every figure, their
    losses agree step by step, and the JSON says so."""
    path = os.path.join(str(tmp_path), "gpu_kernels.json")
    status, printed = _main(["--cpu-smoke", "--out", path])
    assert status == 0, printed
    with open(path) as handle:
        payload = json.load(handle)
    assert payload["ok"] is True and payload["meta"]["mode"] == "cpu-smoke"
    assert "skipped" in payload["kernels"] and payload["hbm"]["source"] == "unknown"
    step = payload["step"]
    assert step["dtype"] == "bfloat16" and step["loss_mismatch"] == []
    assert set(step["variants"]) == {"eager", "zeroc"}
    eager = step["variants"]["eager"]
    for name, summary in step["variants"].items():
        assert summary["ran"] and summary["error"] is None, (name, summary["traceback"])
        assert summary["loss_agrees"] is True
        for key in ("first_step_s", "step_median_s", "tokens_per_s", "over_eager",
                    "final_loss"):
            assert summary[key] is not None and summary[key] > 0, (name, key)
        assert summary["steps_timed"] == step["steps"]
        assert summary["tokens_per_s"] == pytest.approx(
            step["tokens_per_step"] / summary["step_median_s"])
        assert len(summary["losses"]) == 1 + step["warmup"] + step["steps"]
        for ours, theirs in zip(summary["losses"], eager["losses"], strict=True):
            assert ours == pytest.approx(theirs, rel=1e-2, abs=1e-2)
        row = next(line for line in printed.splitlines() if line.startswith(f"{name} "))
        assert "n/a" not in row and "agrees" in row
    assert eager["losses"][-1] < eager["losses"][0]  # the memorized batch is learned


def test_failing_variant_is_reported(tmp_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A variant that raises is n/a with its error; eager still runs; the status is 1."""
    step = _load_script().gpu_step
    build = step.build_variant

    def failing_build(name: str, setup):
        if name == "zeroc":
            raise RuntimeError("injected failure")
        return build(name, setup)

    monkeypatch.setattr(step, "build_variant", failing_build)
    path = os.path.join(str(tmp_path), "out.json")
    status, printed = _main(["--cpu-smoke", "--out", path])
    assert status == 1
    with open(path) as handle:
        variants = json.load(handle)["step"]["variants"]
    assert variants["zeroc"]["error"] == "RuntimeError: injected failure"
    assert "failing_build" in variants["zeroc"]["traceback"]
    assert variants["zeroc"]["step_median_s"] is None
    assert variants["eager"]["ran"] and variants["eager"]["step_median_s"] > 0
    assert "n/a" in next(line for line in printed.splitlines() if line.startswith("zeroc "))


def test_budget_stops_new_work() -> None:
    """Once the budget is spent no variant starts and the rounds stop, but one timed round
    runs after the first steps; a budget of 0 never runs out."""
    step = _load_script().gpu_step
    assert not step.Budget(0).spent(1e9) and step.Budget(1e-9).spent()
    assert not step.Budget(100).spent(50) and step.Budget(100).spent(100)

    class SpentAfter:
        seconds = 1.0

        def __init__(self, calls: int) -> None:
            self.calls = calls

        def spent(self, estimate_s: float = 0.0) -> bool:
            self.calls -= 1
            return self.calls < 0

    cfg = step.GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, d_model=16)
    setup = step.StepSetup(cfg, 2, 5, 2, 3e-4, "cpu", torch.float32, "/unused")
    (eager,) = step.run_variants(setup, ["eager"], SpentAfter(1))
    assert eager.first_step_s > 0 and len(eager.step_s) == 1 and len(eager.losses) == 2
    (eager,) = step.run_variants(setup, ["eager"], SpentAfter(0))
    assert eager.skipped and eager.first_step_s is None and not eager.losses
