"""``zeroc.calibrate()``: a measured profile of this machine, its cache, its tables and its fits.

One process on this CPU with a tiny budget: positive finite figures, a matmul table by shape
class, no collectives and why; the second call reads the file (measuring raises); a corrupt
file, a file without a field and one for another torch version or format are measured again.
The profile round-trips through JSON and ``get_profile`` and plans a job through
``zeroc.explain``. The tables drive the roofline and the collective estimate, and a bad table
names its key. Two gloo ranks measure the collectives: the same figures on both ranks, kept
per world size; a bad group on one rank raises on both.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
from typing import Any

import pytest
import torch
from dist_harness import run_ranks

import zeroc
from zeroc.runtime.cached_files import checksum
from zeroc.runtime.cost import calibration
from zeroc.runtime.cost.hardware import (
    SHAPE_CLASSES,
    HardwareProfile,
    estimate_collective_s,
    estimate_compute_s,
    get_profile,
    shape_class,
)

TINY = 0.02  # seconds per measurement


def _files(cache: Any) -> list[str]:
    folder = os.path.join(str(cache), "calibration")
    return sorted(os.path.join(folder, f) for f in os.listdir(folder))


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[HardwareProfile, str]:
    cache = str(tmp_path_factory.mktemp("calibration-cache"))
    return zeroc.calibrate(cache_dir=cache, seconds=TINY), cache


def test_single_process_calibration_of_this_cpu(measured: tuple[HardwareProfile, str]) -> None:
    profile, cache = measured
    assert profile.name.startswith("cpu-") and profile.name.endswith("-measured")
    figures = [profile.peak_flops["float32"], profile.memory_bytes_per_s, profile.launch_floor_s,
               profile.intra_node_bytes_per_s, profile.inter_node_latency_s]
    assert all(math.isfinite(v) and v > 0 for v in figures), figures
    assert list(profile.matmul_flops) == ["float32"]
    classes = profile.matmul_flops["float32"]
    assert tuple(classes) == SHAPE_CLASSES and all(v > 0 for v in classes.values())
    assert profile.peak_flops["float32"] == max(classes.values())
    assert 1e8 < profile.peak_flops["float32"] < 1e14  # not a unit slip either way
    assert profile.collectives is None
    assert profile.collectives_note == "not measured: torch.distributed is not initialized"
    assert f"torch {torch.__version__}" in profile.source and "backend none" in profile.source
    [path] = _files(cache)
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    with open(path) as handle:
        entry = json.load(handle)
    assert entry["key"]["format"] == calibration.FORMAT
    assert entry["key"]["torch"] == torch.__version__ and entry["key"]["world"] == 1
    assert entry["key"]["backend"] == "none" and entry["key"]["groups"] == []
    assert HardwareProfile.from_dict(entry["data"]) == profile
    assert entry["sha256"] == checksum(calibration.PROFILE_KIND, calibration.FORMAT,
                                       entry["key"], entry["data"])


def _must_not_measure(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("measured again although the cache holds this machine")


def test_second_call_reuses_the_file(measured: tuple[HardwareProfile, str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    profile, cache = measured
    for name in ("measure_matmul", "measure_memory_bandwidth", "measure_launch_floor"):
        monkeypatch.setattr(calibration, name, _must_not_measure)
    assert zeroc.calibrate(cache_dir=cache, seconds=TINY) == profile
    with pytest.raises(AssertionError, match="measured again"):
        zeroc.calibrate(cache_dir=cache, seconds=TINY, force=True)


class _FakeMeasures:
    """Stands in for the three measurements: fixed figures, counting the calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        monkeypatch.setattr(calibration, "measure_matmul", self.matmul)
        monkeypatch.setattr(calibration, "measure_memory_bandwidth", lambda *a: 3e9)
        monkeypatch.setattr(calibration, "measure_launch_floor", lambda *a: 4e-6)

    def matmul(self, device: torch.device, seconds: float) -> dict[str, dict[str, float]]:
        self.calls += 1
        return {"float32": {"small": 1e9, "medium": 2e9, "large": 5e9}}


@pytest.mark.parametrize(("spoil", "reason"), [
    ("bad json", "Expecting"), ("not a dict", "list"), ("no matmul table", "matmul_flops"),
    ("no bandwidth", "memory_bytes_per_s"), ("other torch", "torch = '1.0.0'"),
    ("other format", "format = 0"), ("huge bandwidth", "memory_bytes_per_s = 1e+30"),
    ("two-line note", "collectives_note"), ("edited", "checksum"),
])
def test_corrupt_or_stale_file_is_measured_again(
        measured: tuple[HardwareProfile, str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, spoil: str, reason: str) -> None:
    [path] = _files(measured[1])
    with open(path) as handle:
        entry = json.load(handle)
    if spoil == "no matmul table":
        del entry["data"]["matmul_flops"]
    elif spoil == "no bandwidth":
        del entry["data"]["memory_bytes_per_s"]
    elif spoil == "other torch":
        entry["key"]["torch"] = "1.0.0"
    elif spoil == "other format":
        entry["key"]["format"] = 0
    elif spoil == "huge bandwidth":
        entry["data"]["memory_bytes_per_s"] = 1e30
    elif spoil == "two-line note":
        entry["data"]["collectives_note"] = "two\nlines"
    if spoil != "edited":  # a test's edit: the checksum made right again
        entry["sha256"] = checksum(calibration.PROFILE_KIND, calibration.FORMAT, entry["key"],
                                   entry["data"])
    else:
        entry["data"]["launch_floor_s"] = 1e-3
    text = {"bad json": "{not json", "not a dict": "[1, 2]"}.get(spoil, json.dumps(entry))
    spoiled = tmp_path / "calibration" / os.path.basename(path)
    spoiled.parent.mkdir()
    spoiled.write_text(text)
    fake = _FakeMeasures(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="zeroc.tuning.calibrate"):
        profile = zeroc.calibrate(cache_dir=str(tmp_path), seconds=TINY)
    assert fake.calls == 1 and profile.peak_flops == {"float32": 5e9}
    assert profile.memory_bytes_per_s == 3e9 and profile.launch_floor_s == 4e-6
    [warning] = [r.getMessage() for r in caplog.records if str(spoiled) in r.getMessage()]
    assert reason in warning and "measuring again" in warning
    assert zeroc.calibrate(cache_dir=str(tmp_path), seconds=TINY) == profile  # stored, whole
    assert fake.calls == 1


def test_profile_round_trips_and_plans_a_job(measured: tuple[HardwareProfile, str]) -> None:
    profile = measured[0]
    again = HardwareProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again == profile and hash(again) == hash(profile)
    assert get_profile(profile) is profile and get_profile(profile.to_dict()) == profile
    assert "matmul_flops" not in get_profile("h200").to_dict()  # the JSON's format, unchanged
    from models.gpt import GPT, GPTConfig

    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=32), seed=5)
    plan = zeroc.explain(model, (tokens[:, :-1], tokens[:, 1:]), world=2, device="cpu",
                         hardware=profile)
    assert plan.estimate is not None and plan.estimate.hardware == profile.name
    assert plan.estimate.step_s >= plan.estimate.compute_s >= profile.launch_floor_s


def test_the_shapes_measured_are_in_their_class() -> None:
    for device, classes in calibration.MATMUL_SHAPES.items():
        assert tuple(classes) == SHAPE_CLASSES, device
        for name, shapes in classes.items():
            for m, k, n in shapes:
                assert shape_class(2 * m * k * n) == name, (device, m, k, n)
    assert [shape_class(f) for f in (0, 9.9e7, 1e8, 9.9e9, 1e10, 1e15)] == [
        "small", "small", "medium", "medium", "large", "large"]


def test_roofline_uses_the_class_figure() -> None:
    profile = get_profile({"base": "h100-sxm", "matmul_flops": {
        "bfloat16": {"small": 1e12, "large": 500e12}}})
    assert estimate_compute_s(5e7, 0, torch.bfloat16, profile) == pytest.approx(5e-5)
    assert estimate_compute_s(1e12, 0, "bf16", profile) == pytest.approx(2e-3)
    assert estimate_compute_s(9e9, 0, torch.bfloat16, profile) == pytest.approx(9e9 / 989.4e12)
    assert estimate_compute_s(1e12, 0, torch.float32, profile) == pytest.approx(1e12 / 66.9e12)


def test_collective_estimate_uses_the_measured_fit() -> None:
    fit = {"latency_s": 1e-5, "bytes_per_s": 1e9, "op": "all_gather_into_tensor"}
    profile = get_profile({"base": "h100-sxm", "collectives": {"all_gather": {"2:intra": fit}}})
    assert estimate_collective_s("all_gather", 1e6, 2, profile, False) == pytest.approx(1.01e-3)
    h100 = get_profile("h100-sxm")
    for args in (("all_gather", 1e6, 2, True), ("all_gather", 1e6, 4, False),
                 ("all_reduce", 1e6, 2, False)):
        assert estimate_collective_s(args[0], args[1], args[2], profile, args[3]) == (
            estimate_collective_s(args[0], args[1], args[2], h100, args[3]))


@pytest.mark.parametrize(("changes", "words"), [
    ({"matmul_flops": {"float12": {"small": 1.0}}}, ["'float12'", "bfloat16"]),
    ({"matmul_flops": {"float32": {"huge": 1.0}}}, ["'huge'", "small, medium, large"]),
    ({"matmul_flops": {"float32": {"small": -1.0}}}, ["'small'", "-1.0", "> 0"]),
    ({"collectives": {"broadcast": {}}}, ["'broadcast'", "all_gather"]),
    ({"collectives": {"send": {"two": {}}}}, ["'two'", "'<size>:intra'"]),
    ({"collectives": {"send": {"2:intra": {"latency_s": 0.0, "bytes_per_s": 1.0}}}},
     ["'2:intra'", "'op'"]),
    ({"collectives_note": ""}, ["'collectives_note'", "''"]),
])
def test_bad_tables_name_the_key(changes: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        get_profile({"base": "h200", **changes})
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_fit_line() -> None:
    points = [(n, 2e-5 + n / 1e9) for n in (1e3, 1e6, 1e7)]
    assert calibration.fit_line(points) == pytest.approx((2e-5, 1e9))
    latency, bandwidth = calibration.fit_line([(1e3, 1e-6), (1e6, 1.0e-3), (1e7, 1.1e-2)])
    assert latency == 0.0 and 0.9e9 < bandwidth < 1.0e9  # a negative intercept: through 0
    assert calibration.fit_line([(1e3, 2e-3), (1e6, 1e-3)]) == (1e-3, 1e6 / 2e-3)
    with pytest.raises(ValueError, match="two or more"):
        calibration.fit_line([(1e3, 1e-3)])


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"seconds": 0}, ["seconds = 0", "(0, 60]"]), ({"seconds": True}, ["seconds = True"]),
    ({"seconds": math.inf}, ["seconds = inf"]), ({"force": "yes"}, ["force = 'yes'"]),
    ({"cache_dir": 3}, ["cache_dir = 3"]),
    ({"groups": ["dp"]}, ["groups = ['dp']", "torch.distributed"]),
])
def test_bad_arguments_are_named(kwargs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        zeroc.calibrate(**kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def two_rank_job(rank: int, world: int, cache: str) -> tuple[dict, dict, list[str], str]:
    import torch.distributed as dist

    singles = [dist.new_group([r]) for r in range(world)]  # size 1: nothing to measure
    pair = dist.new_group(list(range(world)))  # the world's size again: measured once
    first = zeroc.calibrate(cache_dir=cache, groups=[pair, singles[rank], None], seconds=TINY)
    calibration.measure_matmul = _must_not_measure  # this rank's module only
    calibration.time_collectives = _must_not_measure
    again = zeroc.calibrate(cache_dir=cache, groups=[pair], seconds=TINY)
    try:  # rank 0 is not in singles[1]: both ranks must raise, neither may wait for the other
        zeroc.calibrate(cache_dir=cache, groups=[singles[1]], seconds=TINY)
        error = ""
    except ValueError as exc:
        error = str(exc)
    files = sorted(os.listdir(os.path.join(cache, "calibration")))
    return first.to_dict(), again.to_dict(), files, error


@pytest.mark.slow
def test_two_gloo_ranks_measure_the_collectives(tmp_path: Any) -> None:
    cache = str(tmp_path)
    zeroc.calibrate(cache_dir=cache, seconds=TINY)  # a world of one: its own file
    results = run_ranks(two_rank_job, 2, cache, timeout=120)
    (first0, again0, files, error0), (first1, again1, _, error1) = results
    assert first0 == first1 == again0 == again1  # the same figures on both ranks, reused
    assert error0.startswith("calibrate: groups[0]") and "not allowed" in error0
    assert error1.startswith("rank 0: calibrate: groups[0]")
    profile = HardwareProfile.from_dict(first0)
    assert profile.devices_per_node == 2 and "backend gloo, world 2" in profile.source
    fits = profile.collectives
    assert set(fits) == {"all_gather", "reduce_scatter", "all_reduce", "send", "recv"}
    for kind, groups in fits.items():
        assert list(groups) == ["2:intra"], kind
        # A loaded host's timings can fit a negative intercept; fit_line then fits through the
        # origin, so the latency is >= 0, not > 0 (see test_fit_line).
        assert groups["2:intra"]["latency_s"] >= 0 and groups["2:intra"]["bytes_per_s"] > 0
    assert "all_to_all" in fits["reduce_scatter"]["2:intra"]["op"]  # gloo's, as zeroc runs it
    assert "gloo" in profile.collectives_note and "2:intra" in profile.collectives_note
    # Both ranks on this host: how much slower they compute together than alone, >= 1.
    assert list(profile.shared_slowdown) == ["2"] and profile.shared_slowdown["2"] >= 1.0
    assert estimate_collective_s("all_reduce", 1 << 20, 2, profile, False) == pytest.approx(
        fits["all_reduce"]["2:intra"]["latency_s"] + (1 << 20)
        / fits["all_reduce"]["2:intra"]["bytes_per_s"])
    assert len(files) == 2 and sum("-gloo-w2-g2intra-" in f for f in files) == 1
    with open(os.path.join(cache, "calibration", next(f for f in files if "-w2-" in f))) as f:
        assert json.load(f)["key"]["groups"] == ["2:intra"]
