"""Hardware profiles: the published figures, user profiles, device names, the CPU calibration
and its cache, and the roofline and ring estimates on hand-computed numbers."""

from __future__ import annotations

import json
import logging
import math
import os
import stat
from typing import Any

import pytest
import torch

from zeroc.runtime.cached_files import checksum
from zeroc.runtime.cost import calibration
from zeroc.runtime.cost import cpu_profile as cpu_profile_module
from zeroc.runtime.cost.cpu_profile import calibrate_cpu, cpu_profile
from zeroc.runtime.cost.hardware import (
    KNOWN_PROFILES,
    HardwareProfile,
    estimate_collective_s,
    estimate_compute_s,
    get_profile,
    profile_for_device_name,
)

T = 1e12
G = 1e9
# The vendors' datasheet figures (dense FLOP/s; NVLink per direction, half the datasheet's).
EXPECTED: dict[str, dict[str, Any]] = {
    "a100-80gb": {
        "peak_flops": {"float32": 19.5 * T, "tf32": 156 * T, "bfloat16": 312 * T,
                       "float16": 312 * T},
        "memory_bytes_per_s": 2039 * G, "memory_bytes": 80 * G,
        "intra_node_bytes_per_s": 300 * G, "inter_node_bytes_per_s": 25 * G,
    },
    "h100-sxm": {
        "peak_flops": {"float32": 66.9 * T, "tf32": 494.7 * T, "bfloat16": 989.4 * T,
                       "float16": 989.4 * T},
        "memory_bytes_per_s": 3350 * G, "memory_bytes": 80 * G,
        "intra_node_bytes_per_s": 450 * G, "inter_node_bytes_per_s": 50 * G,
    },
    "h200": {
        "peak_flops": {"float32": 66.9 * T, "tf32": 494.7 * T, "bfloat16": 989.4 * T,
                       "float16": 989.4 * T},
        "memory_bytes_per_s": 4800 * G, "memory_bytes": 141 * G,
        "intra_node_bytes_per_s": 450 * G, "inter_node_bytes_per_s": 50 * G,
    },
}
COMMON = {"intra_node_latency_s": 3e-6, "inter_node_latency_s": 5e-6, "devices_per_node": 8,
          "launch_floor_s": 5e-6}


def _full_dict(**changes: Any) -> dict[str, Any]:
    data = get_profile("h100-sxm").to_dict()
    data.update(name="my-gpu", source="my measurements")
    data.update(changes)
    return data


def test_known_profiles_are_the_json_ones() -> None:
    assert KNOWN_PROFILES == ("a100-80gb", "h100-sxm", "h200")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_known_profile_holds_datasheet_figures(name: str) -> None:
    profile = get_profile(name)
    assert profile.name == name
    for key, value in {**EXPECTED[name], **COMMON}.items():
        got = getattr(profile, key)
        if key == "peak_flops":
            assert got.keys() == value.keys()
            for dtype, flops in value.items():
                assert got[dtype] == pytest.approx(flops, rel=1e-12), (name, dtype)
        else:
            assert got == pytest.approx(value, rel=1e-12), (name, key)
    assert isinstance(profile.memory_bytes, int) and isinstance(profile.devices_per_node, int)
    assert "datasheet" in profile.source and "dense" in profile.source


def test_flops_for_dtype_names_and_fallback() -> None:
    h100 = get_profile("h100-sxm")
    assert h100.flops_for(torch.bfloat16) == h100.flops_for("bf16") == 989.4e12
    assert h100.flops_for("torch.float16") == h100.flops_for(torch.half) == 989.4e12
    assert h100.flops_for(torch.float32) == h100.flops_for("fp32") == 66.9e12
    assert h100.flops_for("TF32") == 494.7e12
    assert h100.flops_for(torch.int64) == h100.flops_for(torch.float64) == 66.9e12
    with pytest.raises(ValueError, match="float33"):
        h100.flops_for("float33")


def test_round_trip_through_json() -> None:
    for name in KNOWN_PROFILES:
        profile = get_profile(name)
        again = HardwareProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
        assert again == profile and hash(again) == hash(profile)
        assert again.peak_flops is not profile.peak_flops


def test_get_profile_by_name_ignores_case_and_passes_profiles_through() -> None:
    profile = get_profile(" H100-SXM ")
    assert profile.name == "h100-sxm"
    assert get_profile(profile) is profile


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="b300") as info:
        get_profile("b300")
    for name in KNOWN_PROFILES:
        assert name in str(info.value)


def test_get_profile_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="int"):
        get_profile(3)  # type: ignore[arg-type]


def test_full_user_dict() -> None:
    profile = get_profile(_full_dict(memory_bytes=24 * G, devices_per_node=4))
    assert profile.name == "my-gpu" and profile.source == "my measurements"
    assert profile.memory_bytes == 24_000_000_000 and isinstance(profile.memory_bytes, int)
    assert profile.devices_per_node == 4


@pytest.mark.parametrize(("changes", "words"), [
    ({"bogus": 1.0}, ["'bogus'", "1.0", "memory_bytes_per_s"]),
    ({"memory_bytes_per_s": -1.0}, ["'memory_bytes_per_s'", "-1.0", "positive"]),
    ({"intra_node_latency_s": 0}, ["'intra_node_latency_s'", "0", "positive"]),
    ({"launch_floor_s": math.nan}, ["'launch_floor_s'", "nan"]),
    ({"inter_node_bytes_per_s": "50e9"}, ["'inter_node_bytes_per_s'", "'50e9'"]),
    ({"devices_per_node": 1.5}, ["'devices_per_node'", "1.5", "integer"]),
    ({"devices_per_node": True}, ["'devices_per_node'", "True"]),
    ({"memory_bytes": -80}, ["'memory_bytes'", "-80"]),
    ({"peak_flops": {"float32": 1e12, "float12": 1e12}}, ["'float12'", "bfloat16"]),
    ({"peak_flops": {"float32": -1e12}}, ["'float32'", "-1"]),
    ({"peak_flops": {"bfloat16": 1e12}}, ["'peak_flops'", "'float32'"]),
    ({"name": ""}, ["'name'", "''"]),
    ({"source": None}, ["'source'", "None"]),
])
def test_bad_dict_names_the_key_and_value(changes: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        get_profile(_full_dict(**changes))
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_partial_dict_without_base_names_the_missing_keys() -> None:
    with pytest.raises(ValueError) as info:
        get_profile({"name": "x", "memory_bytes": 1})
    message = str(info.value)
    assert "missing" in message and "peak_flops" in message and "'base'" in message
    assert "h100-sxm" in message


def test_base_dict_changes_only_what_it_gives() -> None:
    base = get_profile("h100-sxm")
    profile = get_profile({"base": "H100-SXM", "memory_bytes": 94 * G,
                           "peak_flops": {"float8_e4m3fn": 1979 * T}})
    assert profile.name == "h100-sxm-custom"
    assert profile.memory_bytes == 94_000_000_000
    assert profile.peak_flops == {**base.peak_flops, "float8_e4m3fn": 1979 * T}
    for key in ("memory_bytes_per_s", "intra_node_bytes_per_s", "inter_node_latency_s",
                "devices_per_node", "launch_floor_s"):
        assert getattr(profile, key) == getattr(base, key)
    assert base.source in profile.source and "memory_bytes" in profile.source
    assert base.peak_flops.keys() == EXPECTED["h100-sxm"]["peak_flops"].keys()  # base untouched
    named = get_profile({"base": "h200", "name": "h200-nvl", "inter_node_bytes_per_s": 25 * G})
    assert named.name == "h200-nvl" and named.inter_node_bytes_per_s == 25 * G
    assert get_profile({"base": "h200"}) == get_profile("h200")


def test_base_dict_errors() -> None:
    with pytest.raises(ValueError, match="a100-80gb.*h100-sxm.*h200"):
        get_profile({"base": "v100", "memory_bytes": 1})
    with pytest.raises(ValueError, match="'bogus'"):
        get_profile({"base": "h200", "bogus": 2})
    with pytest.raises(ValueError, match="'memory_bytes_per_s'.*-5"):
        get_profile({"base": "h200", "memory_bytes_per_s": -5})


@pytest.mark.parametrize(("device", "name"), [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA H100 PCIe", None),
    ("NVIDIA H200 NVL", None),
    ("NVIDIA GH200 480GB", None),
    ("NVIDIA A100-SXM4-40GB", None),
    ("NVIDIA A100 80GB PCIe", None),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_profile_for_device_name(device: str, name: str | None) -> None:
    profile = profile_for_device_name(device)
    assert (profile.name if profile else None) == name


def _meminfo_total() -> int | None:
    """MemTotal read here, independently of the module (None without /proc)."""
    if not os.path.exists("/proc/meminfo"):
        return None
    with open("/proc/meminfo") as handle:
        return next((int(line.split()[1]) * 1024 for line in handle
                     if line.startswith("MemTotal:")), None)


def test_calibrate_cpu_measures_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    budgets = []  # the time each measurement is given (not timed here: the machine may be busy)
    for name in ("measure_matmul", "measure_memory_bandwidth", "measure_launch_floor"):
        measure = getattr(calibration, name)

        def given(device, seconds, *args, _measure=measure, _name=name):
            budgets.append((_name, seconds))
            return _measure(device, seconds, *args)

        monkeypatch.setattr(calibration, name, given)
    profile = calibrate_cpu(seconds=1.0)
    # every CPU matmul shape, the copy and the launch floor: the time asked for
    shapes = sum(len(v) for v in calibration.MATMUL_SHAPES["cpu"].values())
    matmul = next(s for n, s in budgets if n == "measure_matmul")
    assert len(budgets) == 3
    assert shapes * matmul + sum(s for n, s in budgets[1:]) == pytest.approx(1.0)
    assert profile.name.startswith("cpu-") and profile.name == profile.name.lower()
    assert " " not in profile.name and "(r)" not in profile.name
    assert list(profile.peak_flops) == ["float32"]
    # plausible for any CPU: not a unit slip of 1000x either way
    assert 1e8 < profile.peak_flops["float32"] < 1e14
    assert 1e8 < profile.memory_bytes_per_s < 1e13
    assert 1e-8 < profile.launch_floor_s < 1e-2
    assert profile.intra_node_bytes_per_s == profile.inter_node_bytes_per_s
    assert profile.intra_node_bytes_per_s == profile.memory_bytes_per_s
    assert profile.intra_node_latency_s == profile.inter_node_latency_s == profile.launch_floor_s
    total = _meminfo_total()
    if total is not None:
        assert profile.memory_bytes == total
    assert profile.source.startswith("measured on ")
    assert f"torch {torch.__version__}" in profile.source
    assert f"{torch.get_num_threads()} threads" in profile.source
    with pytest.raises(ValueError, match="seconds"):
        calibrate_cpu(seconds=0)


class _CountingCalibration:
    """Stands in for ``calibrate_cpu``: a fixed profile, counting the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, seconds: float = 5.0) -> HardwareProfile:
        self.calls += 1
        return get_profile({"base": "h200", "name": "cpu-fake", "source": "measured on test"})


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> _CountingCalibration:
    fake = _CountingCalibration()
    monkeypatch.setattr(cpu_profile_module, "calibrate_cpu", fake)
    return fake


def _cache_file(cache_dir: str) -> str:
    files = os.listdir(os.path.join(cache_dir, "hardware"))
    assert len(files) == 1 and files[0].endswith(".json"), files
    return os.path.join(cache_dir, "hardware", files[0])


def test_cpu_profile_is_measured_once_then_read(tmp_path: Any,
                                                counting: _CountingCalibration) -> None:
    cache = str(tmp_path / "cache")
    first = cpu_profile(cache_dir=cache, seconds=1.0)
    assert counting.calls == 1 and first.name == "cpu-fake"
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    path = _cache_file(cache)
    with open(path) as handle:
        entry = json.load(handle)
    assert entry["key"]["threads"] == torch.get_num_threads()
    assert entry["key"]["torch"] == torch.__version__
    entry["data"]["launch_floor_s"] = 7e-6  # the second call must return the file's figures
    with open(path, "w") as handle:
        json.dump(_resealed(entry), handle)
    second = cpu_profile(cache_dir=cache, seconds=1.0)
    assert counting.calls == 1
    assert second.launch_floor_s == 7e-6 and second.name == "cpu-fake"


def _resealed(entry: dict) -> dict:
    """A record whose checksum is right again after a test edited it."""
    return {**entry, "sha256": checksum(entry["zeroc_cache"], entry["format"], entry["key"],
                                        entry["data"])}


@pytest.mark.parametrize("spoil", ["bad json", "other key", "bad profile", "not a dict",
                                   "huge bandwidth", "edited"])
def test_cpu_profile_redoes_a_corrupt_or_stale_file(
        tmp_path: Any, counting: _CountingCalibration, caplog: pytest.LogCaptureFixture,
        spoil: str) -> None:
    cache = str(tmp_path)
    cpu_profile(cache_dir=cache)
    path = _cache_file(cache)
    with open(path) as handle:
        entry = json.load(handle)
    if spoil == "other key":
        entry["key"]["threads"] += 1
    elif spoil == "bad profile":
        entry["data"]["memory_bytes_per_s"] = -1
    elif spoil == "huge bandwidth":
        entry["data"]["memory_bytes_per_s"] = 1e30
    elif spoil == "edited":
        entry["data"]["launch_floor_s"] = 7e-6
    if spoil != "edited":
        entry = _resealed(entry)
    text = {"bad json": "{not json", "not a dict": "[1, 2]"}.get(spoil, json.dumps(entry))
    with open(path, "w") as handle:
        handle.write(text)
    with caplog.at_level(logging.WARNING, logger="zeroc.runtime.cost.hardware"):
        profile = cpu_profile(cache_dir=cache)
    assert counting.calls == 2 and profile.name == "cpu-fake"
    assert any(path in record.getMessage() for record in caplog.records)
    cpu_profile(cache_dir=cache)  # the file was written again, whole
    assert counting.calls == 2


def test_cpu_profile_unwritable_cache_is_not_fatal(
        tmp_path: Any, counting: _CountingCalibration, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="zeroc.runtime.cost.hardware"):
        profile = cpu_profile(cache_dir=str(blocker))
    assert profile.name == "cpu-fake" and counting.calls == 1
    assert any("could not store" in record.getMessage() for record in caplog.records)


def test_cpu_profile_default_dir_is_private(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, counting: _CountingCalibration) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    cpu_profile()
    cache = tmp_path / ".cache" / "zeroc"
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(cache / "hardware").st_mode) == 0o700
    _cache_file(str(cache))


def test_cpu_profile_round_trips_a_real_measurement(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    measured = cpu_profile(cache_dir=str(tmp_path), seconds=1.0)

    def must_not_run(seconds: float = 5.0) -> HardwareProfile:
        raise AssertionError("calibrated again although the cache holds this machine")

    monkeypatch.setattr(cpu_profile_module, "calibrate_cpu", must_not_run)
    assert cpu_profile(cache_dir=str(tmp_path), seconds=1.0) == measured


def test_estimate_compute_s_roofline() -> None:
    h100 = get_profile("h100-sxm")
    # compute-bound: 1 ms of bf16 work, 1 us of memory traffic
    assert estimate_compute_s(989.4e9, 3.35e6, torch.bfloat16, h100) == pytest.approx(1e-3)
    # the same FLOPs in fp32 take 989.4 / 66.9 times longer
    assert estimate_compute_s(989.4e9, 0, "float32", "h100-sxm") == pytest.approx(989.4 / 66.9e3)
    assert estimate_compute_s(494.7e9, 0, "tf32", h100) == pytest.approx(1e-3)
    # memory-bound: 2 ms of traffic on an H200
    assert estimate_compute_s(1e9, 9.6e9, torch.bfloat16, "h200") == pytest.approx(2e-3)
    # tiny: the launch floor
    assert estimate_compute_s(10, 40, torch.float32, h100) == 5e-6
    assert estimate_compute_s(0, 0, torch.float32, {"base": "h100-sxm",
                                                     "launch_floor_s": 2e-6}) == 2e-6
    with pytest.raises(ValueError, match="flops"):
        estimate_compute_s(-1, 0, torch.float32, h100)


def test_estimate_collective_s_ring_model() -> None:
    h100 = get_profile("h100-sxm")
    full = 3.6e9  # 8 x 450 MB
    ring_intra = 7 / 8 * full / 450e9 + 7 * 3e-6  # 7.021 ms
    ring_inter = 7 / 8 * full / 50e9 + 7 * 5e-6  # 63.035 ms
    assert ring_intra == pytest.approx(7.021e-3) and ring_inter == pytest.approx(63.035e-3)
    for kind in ("all_gather", "reduce_scatter"):
        assert estimate_collective_s(kind, full, 8, h100, False) == pytest.approx(ring_intra)
        assert estimate_collective_s(kind, full, 8, h100, True) == pytest.approx(ring_inter)
    assert estimate_collective_s("all_reduce", full, 8, h100, False) == pytest.approx(14.042e-3)
    assert estimate_collective_s("all_reduce", full, 8, h100, True) == pytest.approx(126.07e-3)
    assert estimate_collective_s("all_gather", 1e9, 2, "a100-80gb", True) == pytest.approx(
        0.5 * 1e9 / 25e9 + 5e-6)
    for kind in ("send", "recv"):
        assert estimate_collective_s(kind, 900e6, 2, h100, False) == pytest.approx(2e-3 + 3e-6)
        assert estimate_collective_s(kind, 1e9, 2, h100, True) == pytest.approx(20e-3 + 5e-6)
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "send"):
        assert estimate_collective_s(kind, full, 1, h100, True) == 0.0


def test_estimate_collective_s_errors() -> None:
    with pytest.raises(ValueError) as info:
        estimate_collective_s("broadcast", 1, 2, "h200", False)
    for kind in ("'broadcast'", "all_gather", "reduce_scatter", "all_reduce", "send", "recv"):
        assert kind in str(info.value)
    with pytest.raises(ValueError, match="group_size = 0"):
        estimate_collective_s("all_gather", 1, 0, "h200", False)
    with pytest.raises(ValueError, match="nbytes = -1"):
        estimate_collective_s("all_gather", -1, 2, "h200", False)
