"""benchmarks/gpu_check.py and its sections (benchmarks/gpu_checks/), on the CPU.

The budget and skip logic, failure capture, the JSON, the MFU and loss arithmetic, the
sync-warning counter (fed made-up warnings), the memory and kernel summaries, the exit
without CUDA (every section skipped, a JSON saying so, run in this process) and a tiny
--cpu-smoke run of every section a CPU can run (one block, one timed round: ``SMALL``), and of
the train section with Inductor too. No test checks a wall-clock time.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from test_gpu_paths_check import check_path_sections

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_check.py")
SECTIONS = ("train", "kernels", "fused_loss", "zero3", "memory", "syncs", "collectives",
            "pipeline")
FLAGS = ("--out", "--json", "--sections", "--time-budget-s", "--d-model", "--n-layer",
         "--n-head", "--seq", "--vocab", "--batch", "--steps", "--warmup", "--probe-steps",
         "--dtype", "--lr", "--configs", "--zero3-precision", "--kernel-rows", "--kernel-cols",
         "--hardware", "--peak-tflops", "--cache-dir", "--cpu-smoke")


@functools.cache
def _load_script():
    """The script as a module (it puts benchmarks/ on sys.path and imports gpu_checks)."""
    spec = importlib.util.spec_from_file_location("benchmarks_gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _package():
    return _load_script().gpu_checks


# The smoke runs' model and steps, smaller than the --cpu-smoke defaults: one block (the
# pipeline section's child takes 4 whatever it is given), one timed train round and no
# warm-up round, and 6 probe steps (the pipeline counts syncs on steps 3-5). No time budget:
# on a loaded machine a slow Inductor compile must not leave zeroc's variant skipped.
SMALL = ("--n-layer", "1", "--steps", "1", "--warmup", "0", "--probe-steps", "6",
         "--time-budget-s", "0")


def _run(args: list[str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def test_help_documents_every_flag() -> None:
    """--help names every flag, every section and the command to run."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        _load_script().parse_args(["--help"])
    assert exit_.value.code == 0
    text = " ".join(out.getvalue().split())
    for word in FLAGS + SECTIONS:
        assert word in text, word
    assert "python benchmarks/gpu_check.py --out $OUT" in text


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without a CUDA device")
def test_without_cuda_every_section_is_skipped(tmp_path) -> None:
    """Without CUDA the script exits 0 and writes a JSON where every section is skipped
    because there is no GPU, with the environment."""
    threads = torch.get_num_threads()
    try:  # in this process: a child would spend most of its time importing torch
        status = _load_script().main(["--out", str(tmp_path / "out")])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    with open(tmp_path / "out" / "gpu_check.json") as handle:
        payload = json.load(handle)
    assert payload["status"] == "skipped" and payload["ok"] is None
    assert payload["mode"] == "no-gpu"
    assert payload["environment"]["torch"] == torch.__version__
    assert "cuda" in payload["environment"] and payload["environment"]["device"] == "cpu"
    assert set(payload["sections"]) == set(SECTIONS)
    for name, record in payload["sections"].items():
        assert record["status"] == "skipped", name
        assert "no CUDA device" in record["reason"], name


def test_budget_and_skip_logic() -> None:
    """A section gets min(its budget, what is left overall); one that needs more than is left,
    is not selected, or needs CUDA on the CPU is skipped with the reason; running past its
    budget is recorded."""
    runner = _package().runner
    now = [100.0]  # a clock the test moves by hand
    seen = {}

    def spend(seconds):
        def run(ctx, budget):
            seen[ctx] = budget.seconds
            now[0] += seconds
            return {"spent": seconds}
        return run

    sections = [runner.Section("a", spend(30), 40, 5, needs_cuda=False),
                runner.Section("b", spend(60), 50, 5, needs_cuda=False),
                runner.Section("c", spend(1), 40, 20, needs_cuda=False),
                runner.Section("d", spend(1), 40, 5, needs_cuda=False),
                runner.Section("e", spend(1), 40, 1, needs_cuda=True),
                runner.Section("f", spend(1), 40, 1, needs_cuda=False)]
    overall = runner.Budget(100, lambda: now[0])
    records = {}
    for section in sections:  # one at a time, each with its name as the context
        records.update(runner.run_sections([section], section.name, overall, selected="abcde",
                                           cuda=False, smoke=True, cleanup=lambda: None))
    assert seen == {"a": 40, "b": 50, "d": 10}  # d: only 10 s were left
    assert records["a"]["status"] == "ok" and records["a"]["budget_s"] == 40
    assert records["a"]["figures"] == {"spent": 30} and not records["a"]["over_budget"]
    assert records["b"]["status"] == "ok" and records["b"]["budget_s"] == 50
    assert records["b"]["over_budget"] and records["b"]["wall_s"] == 60
    assert records["c"]["status"] == "skipped" and "overall budget spent" in records["c"]["reason"]
    assert "10 s of 100 s left" in records["c"]["reason"] and "20 s" in records["c"]["reason"]
    assert records["d"]["status"] == "ok" and records["d"]["budget_s"] == 10
    assert records["e"]["status"] == "skipped" and "needs a CUDA device" in records["e"]["reason"]
    assert records["f"]["status"] == "skipped" and "not selected" in records["f"]["reason"]
    # Without a limit nothing is skipped for time; without CUDA (and not a smoke run) all is.
    unlimited = runner.Budget(0, lambda: now[0])
    assert unlimited.left() == math.inf and not unlimited.spent(1e9)
    runner.run_sections([sections[0]], "a", unlimited, "a", cuda=False, smoke=True,
                        cleanup=lambda: None)
    assert seen["a"] == 0  # no overall limit: the section has none either
    assert runner.skip_reason(sections[2], "c", False, True, unlimited) is None
    assert "no CUDA device" in runner.skip_reason(sections[0], "a", False, False, unlimited)


def test_failure_is_recorded_and_the_others_run() -> None:
    """A section that raises is recorded with type, message and traceback; a SkipSection is a
    skip with its reason; figures with ok False are a failed check; later sections run."""
    runner = _package().runner

    def boom(ctx, budget):
        raise ValueError("injected failure")

    def skip(ctx, budget):
        raise runner.SkipSection("not here")

    sections = [runner.Section("boom", boom, 10, 0, needs_cuda=False),
                runner.Section("skip", skip, 10, 0, needs_cuda=False),
                runner.Section("bad", lambda c, b: {"ok": False, "reason": "off"}, 10, 0, False),
                runner.Section("good", lambda c, b: {"ok": True, "x": 1}, 10, 0, False)]
    cleaned = []
    records = runner.run_sections(sections, None, runner.Budget(0), [s.name for s in sections],
                                  cuda=False, smoke=True, cleanup=lambda: cleaned.append(1))
    error = records["boom"]["error"]
    assert records["boom"]["status"] == "error"
    assert error["type"] == "ValueError" and error["message"] == "injected failure"
    assert "def boom" in error["traceback"] or "boom" in error["traceback"]
    assert records["skip"]["status"] == "skipped" and records["skip"]["reason"] == "not here"
    assert records["bad"]["status"] == "check_failed" and records["bad"]["reason"] == "off"
    assert records["good"]["status"] == "ok" and records["good"]["figures"]["x"] == 1
    assert len(cleaned) == 4
    assert runner.overall_status(records) == "error"
    assert runner.overall_status({"g": records["good"], "s": records["skip"]}) == "ok"
    assert runner.overall_status({"s": records["skip"]}) == "skipped"


def test_main_records_a_failing_section(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through main: a raising section lands in the JSON, the others still run, exit 1."""
    gpu_check = _load_script()
    runner = gpu_check.gpu_checks.runner

    def boom(ctx, budget):
        raise RuntimeError("injected failure")

    fake = (runner.Section("train", boom, 10, 0, needs_cuda=False),
            runner.Section("fused_loss", lambda c, b: {"rows": c.batch}, 10, 0, False))
    monkeypatch.setattr(gpu_check.gpu_checks, "SECTIONS", fake)
    threads = torch.get_num_threads()
    try:
        status = gpu_check.main(["--cpu-smoke", "--sections", "train,fused_loss",
                                 "--json", str(tmp_path / "x.json")])
    finally:
        torch.set_num_threads(threads)
    assert status == 1
    payload = json.loads((tmp_path / "x.json").read_text())
    assert payload["status"] == "error" and payload["ok"] is False
    train = payload["sections"]["train"]
    assert train["error"]["type"] == "RuntimeError"
    assert train["error"]["message"] == "injected failure"
    assert payload["sections"]["fused_loss"]["figures"] == {"rows": 4}


def test_json_is_strict_and_complete(tmp_path) -> None:
    """write_json makes the directory and writes strict JSON: NaN and infinities as strings,
    tuples as lists, dtypes and other objects as strings, dataclasses as dicts."""
    runner = _package().runner
    probe = _package().probe.Probe("zeroc", losses=[1.0, float("nan")])
    path = tmp_path / "a" / "b" / "out.json"
    runner.write_json(str(path), {"x": (1, float("inf")), "d": torch.bfloat16, "p": probe,
                                  "n": None, 3: -float("inf")})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    payload = json.loads(text)
    assert payload["x"] == [1, "inf"] and payload["d"] == "torch.bfloat16"
    assert payload["p"]["config"] == "zeroc" and payload["p"]["losses"] == [1.0, "nan"]
    assert payload["n"] is None and payload["3"] == "-inf"


def test_mfu_arithmetic() -> None:
    """MFU = FLOPs per step / step seconds / peak; missing or zero figures give None."""
    flops = _package().flops
    assert flops.mfu(6e12, 0.01, 989.4e12) == pytest.approx(6e14 / 989.4e12)
    assert flops.achieved_flops(6e12, 0.01) == pytest.approx(6e14)
    for args in ((None, 0.01, 1e15), (6e12, None, 1e15), (6e12, 0.0, 1e15), (6e12, 0.01, None),
                 (6e12, 0.01, 0.0)):
        assert flops.mfu(*args) is None, args
    cfg = _package().GPTConfig(vocab_size=100, block_size=8, n_layer=2, n_head=2, d_model=16)
    per_block = 16 * 48 + 16 * 16 + 16 * 64 * 2
    expected = 6 * (2 * per_block + 16 * 100) * 24 + 12 * 2 * 16 * 8 * 24
    assert flops.analytic_flops(cfg, 3) == expected
    used = flops.step_flops(cfg, 3, {"counted": None, "by_op": {}, "error": "x"})
    assert used["used"] == expected and used["basis"].startswith("analytic")
    counted = flops.step_flops(cfg, 3, {"counted": 123, "by_op": {"aten.mm": 123}})
    assert counted["used"] == 123 and "without attention" in counted["basis"]


def test_peak_flops_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """--peak-tflops wins; a known --hardware gives the profile's peak; an unknown device, a
    bad name, no device name and a missing hardware module give no peak and a reason."""
    flops = _package().flops
    given = flops.resolve_peak("h200", "NVIDIA H200", torch.bfloat16, peak_tflops=500.0)
    assert given["peak_flops"] == 500e12 and given["source"] == "--peak-tflops"
    from zeroc.runtime.cost.hardware import get_profile

    found = flops.resolve_peak("h200", None, torch.bfloat16)
    assert found["name"] == "h200" and found["reason"] is None
    assert found["peak_flops"] == get_profile("h200").flops_for(torch.bfloat16)
    for hardware, device in ((None, "Some Unknown Accelerator"), ("no-such-gpu", None),
                             (None, None)):
        found = flops.resolve_peak(hardware, device, torch.bfloat16)
        assert found["peak_flops"] is None and found["reason"], (hardware, device)
    monkeypatch.setitem(sys.modules, "zeroc.runtime.cost.hardware", None)  # import raises
    found = flops.resolve_peak("h200", "NVIDIA H200", torch.bfloat16)
    assert found["peak_flops"] is None
    assert "zeroc.runtime.cost.hardware is not available" in found["reason"]


def test_loss_rule_and_train_figures() -> None:
    """Losses agree step by step within rtol * |eager| + atol (NaN, a short run or no eager do
    not); train_figures adds MFU and the comparison, and fails on a raise or a disagreement
    but not on a variant the budget left out."""
    train = _package().train
    rtol, atol = train.TOLERANCE[torch.bfloat16]
    reference = [10.0, 9.0, 8.0]
    close = [v + 0.9 * (rtol * v + atol) for v in reference]
    assert train.compare_losses(close, reference, torch.bfloat16)["agree"]
    far = [10.0, 9.0, 8.0 + 1.1 * (rtol * 8.0 + atol)]
    assert not train.compare_losses(far, reference, torch.bfloat16)["agree"]
    assert not train.compare_losses([10.0, math.nan, 8.0], reference, torch.bfloat16)["agree"]
    assert not train.compare_losses(reference[:2], reference, torch.bfloat16)["agree"]
    assert not train.compare_losses(reference, None, torch.bfloat16)["agree"]

    def variant(losses, step, error=None, skipped=None):
        return {"ran": error is None and skipped is None, "error": error, "skipped": skipped,
                "losses": losses, "step_median_s": step}

    variants = {"eager": variant(reference, 0.02), "zeroc": variant(close, 0.01),
                "inductor": variant([], None, skipped="budget")}
    figures = train.train_figures(variants, 1e12, 1e15, torch.bfloat16)
    assert figures["ok"] and figures["reason"] is None
    assert variants["zeroc"]["mfu"] == pytest.approx(0.1)
    assert variants["zeroc"]["achieved_tflops"] == pytest.approx(100.0)
    assert variants["zeroc"]["loss_comparison"]["agree"]
    assert variants["inductor"]["loss_comparison"] is None and variants["inductor"]["mfu"] is None
    variants = {"eager": variant(reference, 0.02), "zeroc": variant(far, 0.01),
                "inductor": variant([], None, error="RuntimeError: x")}
    figures = train.train_figures(variants, 1e12, None, torch.bfloat16)
    assert not figures["ok"] and "zeroc's losses disagree" in figures["reason"]
    assert "inductor failed" in figures["reason"] and variants["zeroc"]["mfu"] is None
    assert "MFU unknown: why" == train.format_mfu(variants, {"peak_flops": None, "reason": "why"})


def _warning(message: str, filename: str, lineno: int) -> warnings.WarningMessage:
    return warnings.WarningMessage(UserWarning(message), UserWarning, filename, lineno)


def test_sync_warning_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only "called a synchronizing CUDA operation" warnings count, by source line; the
    counter sets the sync debug mode to warn while inside and restores it after."""
    probe = _package().probe
    sync = "called a synchronizing CUDA operation (Triggered internally at Functions.cpp:1)"
    records = [_warning(sync, "a.py", 3), _warning(sync, "a.py", 3), _warning(sync, "b.py", 9),
               _warning("something else", "c.py", 1)]
    counted = probe.count_sync_warnings(records)
    assert counted == {"syncs": 3, "sources": {"a.py:3": 2, "b.py:9": 1}, "other_warnings": 1}
    assert probe.count_sync_warnings([])["syncs"] == 0

    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with probe.SyncCounter(True) as counter:
        warnings.warn(sync, stacklevel=1)
        warnings.warn(sync, stacklevel=1)  # the same line again: "always" keeps both
        warnings.warn("unrelated", stacklevel=1)
    assert modes == ["warn", 0]
    assert counter.result["syncs"] == 2 and counter.result["other_warnings"] == 1
    with pytest.warns(UserWarning, match="left to pytest"), probe.SyncCounter(False) as off:
        warnings.warn("left to pytest", stacklevel=1)
    assert off.result is None and modes == ["warn", 0]

    found = probe.Probe("zeroc", syncs={3: counted, 4: probe.count_sync_warnings(records[:1])})
    figures = probe.sync_figures(found)
    assert figures["per_step"] == {"3": 3, "4": 1} and figures["max_per_step"] == 3
    assert figures["sources"] == {"a.py:3": 3, "b.py:9": 1}


def test_memory_kernel_and_fused_loss_figures() -> None:
    """The measured peak over the plan's largest per-rank peak; per-dtype geometric means of
    zeroc's kernel times over Inductor's, and the patterns that did not match; the fused
    loss's differences from eager's and the rule they must meet."""
    probe = _package().probe
    found = probe.Probe("zeroc", peak_bytes=1500, plan_memory=[
        {"rank": 0, "params": 1, "grads": 1, "optimizer": 2, "activations": 996, "peak": 1000}])
    figures = probe.memory_figures(found)
    assert figures["plan_peak_bytes"] == 1000 and figures["measured_over_plan"] == 1.5
    assert probe.memory_figures(probe.Probe("zeroc"))["measured_over_plan"] is None
    kernels = _package().kernels
    assert kernels.geomean([2.0, 0.5, None, 0.0]) == pytest.approx(1.0)
    assert kernels.geomean([None]) is None
    rows = [{"pattern": "softmax", "dtype": "bfloat16", "zeroc_over_inductor": 0.5,
             "zeroc_over_eager": 0.25, "zeroc_ok": True},
            {"pattern": "gelu", "dtype": "bfloat16", "zeroc_over_inductor": 2.0,
             "zeroc_over_eager": 1.0, "zeroc_ok": False},
            {"pattern": "rmsnorm", "dtype": "float32", "zeroc_ok": False, "error": "x"}]
    summary = kernels.kernel_summary(rows)
    assert summary["bfloat16"]["zeroc_over_inductor_geomean"] == pytest.approx(1.0)
    assert summary["bfloat16"]["zeroc_over_eager_geomean"] == pytest.approx(0.5)
    assert summary["bfloat16"]["mismatched_or_failed"] == ["gelu"]
    assert summary["float32"] == {"patterns": 1, "zeroc_over_inductor_geomean": None,
                                  "zeroc_over_eager_geomean": None,
                                  "mismatched_or_failed": ["rmsnorm"]}
    # The fused loss agrees with eager's within rtol of each output's largest magnitude.
    eager = (torch.tensor(10.0), torch.full((2, 3), 1e-4), torch.full((4, 3), -2e-3))
    close = (torch.tensor(10.1), torch.full((2, 3), 1.01e-4), torch.full((4, 3), -2.02e-3))
    diffs = kernels.max_abs_diffs(close, eager)
    assert diffs["loss"] == pytest.approx(0.1, rel=1e-4)
    assert diffs["grad_w"] == pytest.approx(2e-5, rel=1e-3)
    assert kernels.diffs_within(diffs, eager, torch.bfloat16)
    wrong = (eager[0], torch.full((2, 3), 2e-4), eager[2])  # far below any absolute tolerance
    assert not kernels.diffs_within(kernels.max_abs_diffs(wrong, eager), eager, torch.bfloat16)
    nan = (torch.tensor(math.nan), eager[1], eager[2])
    assert not kernels.diffs_within(kernels.max_abs_diffs(nan, eager), eager, torch.bfloat16)


@pytest.mark.timeout(200)
def test_cpu_smoke_runs_every_cpu_section(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--cpu-smoke trains eager and zeroc, runs the fused loss, ZeRO-3 on a world-1 gloo group,
    the memory probe, ZeRO-3 (exact, quantized, offloaded) with its collectives kept on that
    group and both positions of a pp=2 pipeline on the CPU; losses agree with eager's; the
    CUDA-only sections are skipped."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # restored after
    threads = torch.get_num_threads()
    try:
        status = _load_script().main(["--cpu-smoke", "--hardware", "h200", "--out",
                                      str(tmp_path), "--cache-dir", str(tmp_path / "cache"),
                                      *SMALL])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    payload = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = payload["sections"]
    assert payload["status"] == "ok" and payload["mode"] == "cpu-smoke"
    assert {n for n, r in sections.items() if r["status"] == "skipped"} == {"kernels", "syncs"}
    train = sections["train"]["figures"]
    for name in ("eager", "zeroc"):
        v = train["variants"][name]
        assert v["ran"] and v["loss_comparison"]["agree"] and v["mfu"] > 0, name
        assert v["step_median_s"] > 0 and v["tokens_per_s"] > 0
    assert train["flops_per_step"]["used"] > 0
    fused = sections["fused_loss"]["figures"]["variants"]["fused"]
    assert fused["agrees_with_eager"] and fused["median_s"] > 0
    zero3 = sections["zero3"]["figures"]
    assert zero3["process_group"]["backend"] == "gloo" and zero3["loss_comparison"]["agree"]
    assert len(zero3["zero3_losses"]) == payload["settings"]["probe_steps"]
    memory = sections["memory"]["figures"]["configs"]
    assert memory["zeroc"]["plan_peak_bytes"] > 0 and memory["zeroc_zero3"]["plan_peak_bytes"] > 0
    check_path_sections(sections)  # collectives kept on the world-1 group; the pipeline


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cpu_smoke_with_inductor(tmp_path) -> None:
    """The train section with Inductor too (slow C++ compiles on the CPU)."""
    result = _run(["--cpu-smoke", "--sections", "train", "--configs", "eager,inductor,zeroc",
                   "--json", str(tmp_path / "g.json"), *SMALL], str(tmp_path), 560)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    variants = json.loads((tmp_path / "g.json").read_text())["sections"]["train"]["figures"][
        "variants"]
    assert set(variants) == {"eager", "inductor", "zeroc"}
    eager = variants["eager"]["losses"]
    for name, v in variants.items():
        assert v["ran"] and v["loss_comparison"]["agree"], (
            name, v["loss_comparison"], v["losses"], eager, v.get("error"), v.get("skipped"))
        assert v["over_inductor"] > 0
