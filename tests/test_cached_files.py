"""Every file zeroc reads back is checked before it is used (``zeroc.runtime.cached_files``).

The reader refuses, with one log line naming the file, a record another user owns, one that
group or others can write (or whose directory they can), a link, an oversized file, NaN or
Infinity, a wrong checksum, kind, format or key; each cache's own check refuses values out of
range. Each cache then measures or plans again: op-time tables with -1, NaN or 1e30 s, CPU
profiles others can write, tuned layouts that carry ``loss_reduction`` or ``cache_dir``, were
written by others or for other versions, and tune results with negative figures.
"""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest
import torch
from models.gpt import GPT, GPTConfig

import zeroc
from zeroc.runtime import cached_files
from zeroc.runtime.cached_files import (
    RecordError,
    checksum,
    fields,
    integer,
    number,
    read_record,
    text,
    write_record,
)
from zeroc.runtime.cost import cpu_profile as cpu_profile_module
from zeroc.runtime.cost.hardware import get_profile
from zeroc.runtime.cost.op_timing import OpTimes, encode_call
from zeroc.runtime.errors import OptionError
from zeroc.sharding.tune_cache import (
    TUNE_FORMAT,
    layout_key,
    layout_path,
    read_cached,
    result_key,
    versions,
    write_cached,
)
from zeroc.tuning.tune_space import Candidate, model_key

KEY = {"machine": "test", "torch": "1"}


def _write(tmp_path, data=None, key=KEY) -> str:
    path = str(tmp_path / "cache" / "things" / "a.json")
    write_record(str(tmp_path / "cache"), path, "thing", 1, key, data or {"x": 1.5})
    return path


def _read(tmp_path, path: str, **kwargs):
    return read_record(path, "thing", 1, kwargs.pop("key", KEY), root=str(tmp_path / "cache"),
                       what="thing", **kwargs)


def test_a_record_is_private_checksummed_and_read_back(tmp_path) -> None:
    path = _write(tmp_path)
    for place in (tmp_path / "cache", tmp_path / "cache" / "things"):
        assert stat.S_IMODE(os.stat(place).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with open(path) as handle:
        record = json.load(handle)
    assert record["sha256"] == checksum("thing", 1, KEY, {"x": 1.5})
    assert _read(tmp_path, path) == {"x": 1.5}
    assert _read(tmp_path, str(tmp_path / "cache" / "things" / "missing.json")) is None


def _spoil(tmp_path, path: str, how: str, monkeypatch) -> str:
    """Spoil the record at ``path``; return what the refusal must say."""
    with open(path) as handle:
        record = json.load(handle)
    if how == "world-writable file":
        os.chmod(path, 0o666)
        return "writable by group or others (mode 0o666)"
    if how == "group-writable directory":
        os.chmod(os.path.dirname(path), 0o770)
        return "writable by group or others (mode 0o770)"
    if how == "another user's":
        owner = os.stat(path).st_uid
        monkeypatch.setattr(os, "getuid", lambda: owner + 4242)
        return f"owned by uid {owner}, not by you"
    if how == "link":
        os.rename(path, path + ".real")
        os.symlink(path + ".real", path)
        return "symbolic link"
    if how == "too large":
        with open(path, "a") as handle:
            handle.write(" " * 2048)
        return "more than the 1024 allowed"
    texts = {
        "nan": json.dumps(record).replace("1.5", "NaN"),
        "edited": json.dumps({**record, "data": {"x": 2.5}}),
        "other kind": json.dumps({**record, "zeroc_cache": "other"}),
        "other format": json.dumps({**record, "format": 0}),
        "other key": json.dumps({**record, "key": {**KEY, "torch": "0"},
                                 "sha256": checksum("thing", 1, {**KEY, "torch": "0"},
                                                    record["data"])}),
        "old layout": json.dumps({"versions": {}, "best": {"zero": 3, "pp": 1}}),
    }
    with open(path, "w") as handle:
        handle.write(texts[how])
    return {"nan": "NaN, not a finite number", "edited": "checksum does not match",
            "other kind": "not a zeroc 'thing' record", "other format": "record format 0",
            "other key": "torch = '0', here '1'", "old layout": "not a zeroc 'thing'"}[how]


@pytest.mark.parametrize("how", ["world-writable file", "group-writable directory",
                                 "another user's", "link", "too large", "nan", "edited",
                                 "other kind", "other format", "other key", "old layout"])
def test_a_bad_record_is_ignored_with_one_line_naming_it(tmp_path, monkeypatch, caplog,
                                                         how: str) -> None:
    path = _write(tmp_path)
    reason = _spoil(tmp_path, path, how, monkeypatch)
    with caplog.at_level(logging.INFO, logger="zeroc"):
        assert _read(tmp_path, path, max_bytes=1024) is None
    [line] = [r.getMessage() for r in caplog.records]
    assert path in line and reason in line and line.endswith("measuring again"), line


def test_the_schema_helpers_name_what_is_out_of_range() -> None:
    assert number(2, "x", 0.0, 3.0) == 2.0 and integer(3, "n", 1, 3) == 3
    for value in (-1, float("nan"), float("inf"), 1e30, True, "1"):
        with pytest.raises(RecordError, match="x = "):
            number(value, "x", 0.0, 1e15)
    with pytest.raises(RecordError, match=r"n = 2.0 is not an integer in \[1, 3\]"):
        integer(2.0, "n", 1, 3)
    with pytest.raises(RecordError, match="not one line"):
        text("a\nb", "source")
    with pytest.raises(RecordError, match=r"missing keys \['b'\], unknown keys \['c'\]"):
        fields({"a": 1, "c": 2}, "entry", ("a", "b"))


@pytest.mark.parametrize("entry", [-1.0, float("nan"), 1e30])
def test_an_op_time_table_with_a_bad_time_is_measured_again(tmp_path, caplog, entry) -> None:
    call = encode_call(torch.ops.aten.add.Tensor, (torch.ones(64), torch.ones(64)), {})
    first = OpTimes(str(tmp_path))
    assert first.seconds(call) > 0
    first.save()
    with open(first.path) as handle:
        record = json.load(handle)
    record["data"][call] = entry
    if entry == entry:  # a finite entry gets a right checksum: the range check refuses it
        record["sha256"] = checksum("op times", 1, record["key"], record["data"])
    with open(first.path, "w") as handle:
        handle.write(json.dumps(record))  # NaN written as NaN: refused as not JSON numbers
    with caplog.at_level(logging.WARNING, logger="zeroc.runtime.cost.op_timing"):
        again = OpTimes(str(tmp_path))
    assert again.times == {} and again.measured == 0
    [line] = [r.getMessage() for r in caplog.records]
    assert first.path in line and "op timing table" in line
    seconds = again.seconds(call)
    assert seconds is not None and 0 < seconds < 1 and again.measured == 1


def test_an_op_time_table_others_can_write_is_measured_again(tmp_path, caplog) -> None:
    call = encode_call(torch.ops.aten.add.Tensor, (torch.ones(64), torch.ones(64)), {})
    first = OpTimes(str(tmp_path))
    first.seconds(call)
    first.save()
    assert OpTimes(str(tmp_path)).times  # read back while private
    os.chmod(first.path, 0o664)
    with caplog.at_level(logging.WARNING, logger="zeroc.runtime.cost.op_timing"):
        assert OpTimes(str(tmp_path)).times == {}
    assert "writable by group or others" in caplog.text


def test_a_cpu_profile_others_can_write_is_measured_again(tmp_path, monkeypatch,
                                                          caplog) -> None:
    calls = []

    def measure(seconds: float = 5.0):
        calls.append(seconds)
        return get_profile({"base": "h200", "name": "cpu-fake", "source": "measured on test"})

    monkeypatch.setattr(cpu_profile_module, "calibrate_cpu", measure)
    cpu_profile_module.cpu_profile(cache_dir=str(tmp_path))
    cpu_profile_module.cpu_profile(cache_dir=str(tmp_path))
    assert len(calls) == 1
    [path] = [os.path.join(tmp_path, "hardware", f) for f in os.listdir(tmp_path / "hardware")]
    os.chmod(path, 0o646)
    with caplog.at_level(logging.WARNING, logger="zeroc"):
        cpu_profile_module.cpu_profile(cache_dir=str(tmp_path))
    assert len(calls) == 2 and path in caplog.text and "writable by group" in caplog.text


def _model() -> GPT:
    return GPT(GPTConfig.tiny(), seed=0)


def _inputs(rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (rows, 16), generator=torch.Generator().manual_seed(0))
    return tokens, tokens


def _plant_layout(cache: str, options: dict, key: dict | None = None) -> str:
    """A ``.layout`` record with a right checksum holding ``options`` (as a planted one)."""
    model = _model()
    path = layout_path(cache, model, 1, "cpu")
    key = key or layout_key(model, 1, "cpu")
    write_record(cache, path, "tune layout", TUNE_FORMAT, key,
                 {"best": {"zero": 0, "pp": 1, "options": options},
                  "inputs": [[4, 16], [4, 16]], "source": "planted.json"})
    return path


@pytest.mark.parametrize("options", [{"loss_reduction": "sum"}, {"cache_dir": "/elsewhere"},
                                     {"bucket_mb": float(1 << 30)}, {"microbatches": 0}])
def test_a_layout_with_options_the_tuner_never_chooses_is_refused(tmp_path, caplog,
                                                                  options) -> None:
    path = _plant_layout(str(tmp_path), options)
    with caplog.at_level(logging.WARNING, logger="zeroc"), \
            pytest.raises(OptionError, match="no tuned layout for this model"):
        zeroc.parallelize(_model(), layout="auto", cache_dir=str(tmp_path))
    [line] = [r.getMessage() for r in caplog.records if path in r.getMessage()]
    assert next(iter(options)) in line and "tuned layout" in line


@pytest.mark.parametrize("how", ["world-writable layout", "world-writable tune directory",
                                 "another user's", "other versions"])
def test_a_layout_others_wrote_or_for_other_versions_is_refused(tmp_path, monkeypatch,
                                                                caplog, how) -> None:
    model, cache = _model(), str(tmp_path)
    write_cached(cache, model, _inputs(), 1, "cpu", Candidate(0, 1, (("fused_loss", False),)),
                 [])
    path = layout_path(cache, model, 1, "cpu")
    assert zeroc.parallelize(_model(), layout="auto", cache_dir=cache)._zeroc_layout.tuned_from
    if how == "world-writable layout":
        os.chmod(path, 0o666)
    elif how == "world-writable tune directory":
        os.chmod(os.path.dirname(path), 0o777)
    elif how == "another user's":
        owner = os.stat(path).st_uid
        monkeypatch.setattr(os, "getuid", lambda: owner + 1)
    else:
        _plant_layout(cache, {}, {**layout_key(model, 1, "cpu"),
                                  "versions": {**versions(), "torch": "0.0"}})
    with caplog.at_level(logging.WARNING, logger="zeroc"), \
            pytest.raises(OptionError, match="no tuned layout for this model"):
        zeroc.parallelize(_model(), layout="auto", cache_dir=cache)
    assert path in caplog.text


def test_a_layout_for_other_input_shapes_applies_zero_and_pp_only(tmp_path, caplog) -> None:
    cache = str(tmp_path)
    write_cached(cache, _model(), _inputs(4), 1, "cpu",
                 Candidate(0, 1, (("fused_loss", False), ("partitioner", "default"))), [])
    model = zeroc.parallelize(_model(), layout="auto", cache_dir=cache)
    compiled = torch.compile(model, backend="zeroc")
    with caplog.at_level(logging.WARNING, logger="zeroc"):
        compiled(*_inputs(2)).backward()
    assert "tuned for inputs of shapes 4x16, 4x16" in caplog.text
    plan = zeroc.explain(compiled)
    assert dict(plan.meta.options)["partitioner"] == "min_cut"  # the default, not the tuned
    first = " ".join(line.strip() for line in str(plan).split("\ndevice")[0].splitlines())
    assert "tuned by zeroc.tune" in first and "input shapes differ (tuned 4x16, 4x16)" in first


@pytest.mark.parametrize("figure", [("estimated_s", -1.0), ("measured_s", 1e30),
                                    ("peak_bytes", -5), ("rejected", "two\nlines")])
def test_a_tune_result_with_figures_out_of_range_is_refused(tmp_path, caplog,
                                                            figure) -> None:
    model, inputs, cache = _model(), _inputs(), str(tmp_path)
    trial = {"candidate": {"zero": 0, "pp": 1, "options": {}}, "estimated_s": 0.1,
             "peak_bytes": 1000, "measured_s": 0.2, "rejected": "", "parts": {},
             "screened_s": None}
    path = write_cached(cache, model, inputs, 1, "cpu", Candidate(0, 1), [trial])
    key = model_key(model, inputs)
    assert read_cached(path, key, 1, "cpu")["best"] == Candidate(0, 1)
    data = {"best": {"zero": 0, "pp": 1, "options": {}}, "trials": [{**trial, figure[0]:
                                                                      figure[1]}]}
    write_record(cache, path, "tune result", TUNE_FORMAT, result_key(key, 1, "cpu"), data)
    with caplog.at_level(logging.WARNING, logger="zeroc"):
        assert read_cached(path, key, 1, "cpu") is None
    assert f"trials[0].{figure[0]}" in caplog.text and "tuning again" in caplog.text


def test_the_reader_sits_in_the_bottom_layer() -> None:
    assert cached_files.__name__ == "zeroc.runtime.cached_files"
    source = open(cached_files.__file__).read()
    assert "from zeroc." not in source.replace("from zeroc.runtime.", "")
