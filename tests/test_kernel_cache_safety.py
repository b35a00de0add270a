"""The kernel cache runs only what zeroc wrote, in directories only the user can write.

A kernel file is imported only when its content hashes to the source just generated (else it
is rewritten first), so a payload planted at the predictable path never runs; the cache's
directories are created 0o700, and a cache directory that group or others can write, or that
another user owns, is refused with an OptionError naming it. Corrupt kernel files and corrupt
or mismatching tuning records are replaced with a warning, never fatal.

Kernels are zeroc's own (``kernels="triton"``) for ``x * 2 + 1``, launched on CPU tensors by
the Triton interpreter in this process (the source calls no Triton library function).
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import stat
import types

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from zeroc.codegen import autotune, compile_cache
from zeroc.codegen.fused_kernel import FusedKernel
from zeroc.passes.base import PassContext
from zeroc.passes.fusion import fusion
from zeroc.runtime.cached_files import checksum
from zeroc.runtime.errors import OptionError


def affine(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0 + 1.0


@pytest.fixture
def interpreter(monkeypatch):
    """The Triton interpreter and empty in-memory module and tuning caches."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(compile_cache, "_modules", {})
    monkeypatch.setattr(autotune, "_memory", {})
    return monkeypatch


def fused(cache_dir: str, tune: bool = False):
    """(graph module, its FusedKernel) for ``affine`` on a 30 x 16 input."""
    gm = make_fx(affine, tracing_mode="fake")(torch.randn(30, 16))
    config = types.SimpleNamespace(kernels="triton", cache_dir=cache_dir, kernel_autotune=tune)
    result = fusion(gm, PassContext(config, "g0.inference", "inference"))
    [kernel] = [n.target for n in result.gm.graph.nodes if isinstance(n.target, FusedKernel)]
    return result.gm, kernel


def check_runs(gm) -> None:
    x = torch.randn(30, 16)
    torch.testing.assert_close(gm(x), affine(x))


def test_planted_payload_at_the_kernel_path_never_runs(interpreter, tmp_path, caplog):
    cache = str(tmp_path / "cache")
    gm, kernel = fused(cache)
    path = compile_cache.kernel_path(kernel.source, cache)
    assert not os.path.exists(path)  # nothing written or run at compile time
    marker = tmp_path / "payload_ran"
    payload = (f"import builtins, pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
               "builtins.ZEROC_PAYLOAD_RAN = True\n"
               f"def {kernel.ir.name}(*args, **kwargs):\n    raise SystemExit('payload')\n")
    os.makedirs(os.path.dirname(path), mode=0o700)
    with open(path, "w") as handle:
        handle.write(payload)
    with caplog.at_level(logging.WARNING, logger="zeroc.codegen.compile_cache"):
        check_runs(gm)
    assert not marker.exists() and not hasattr(builtins, "ZEROC_PAYLOAD_RAN")
    with open(path) as handle:
        assert handle.read() == kernel.source
    assert "rewriting it" in caplog.text and path in caplog.text


@pytest.mark.parametrize("corruption", ["truncated", "binary"])
def test_corrupt_kernel_file_is_replaced(interpreter, tmp_path, caplog, corruption):
    cache = str(tmp_path / "cache")
    gm, kernel = fused(cache)
    path = compile_cache.kernel_path(kernel.source, cache)
    os.makedirs(os.path.dirname(path), mode=0o700)
    content = {"truncated": kernel.source[: len(kernel.source) // 2].encode(),
               "binary": b"def broken(:\n\xff\xfe"}[corruption]
    with open(path, "wb") as handle:
        handle.write(content)
    with caplog.at_level(logging.WARNING):
        check_runs(gm)
    with open(path) as handle:
        assert handle.read() == kernel.source
    assert "rewriting it" in caplog.text


def test_a_matching_kernel_file_others_can_write_is_rewritten(interpreter, tmp_path, caplog):
    cache = str(tmp_path / "cache")
    gm, kernel = fused(cache)
    path = compile_cache.kernel_path(kernel.source, cache)
    os.makedirs(os.path.dirname(path), mode=0o700)
    with open(path, "w") as handle:
        handle.write(kernel.source)
    os.chmod(path, 0o666)
    with caplog.at_level(logging.WARNING, logger="zeroc.codegen.compile_cache"):
        check_runs(gm)
    assert "not trusted" in caplog.text and "writable by group or others" in caplog.text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_matching_file_is_reused_not_rewritten(interpreter, tmp_path):
    cache = str(tmp_path / "cache")
    gm, kernel = fused(cache)
    check_runs(gm)
    path = compile_cache.kernel_path(kernel.source, cache)
    before = os.stat(path).st_ino
    interpreter.setattr(compile_cache, "_modules", {})
    check_runs(fused(cache)[0])
    assert os.stat(path).st_ino == before


def test_cache_directories_are_created_private(interpreter, tmp_path):
    cache = tmp_path / "new" / "cache"
    old = os.umask(0o000)  # a permissive umask must not widen the cache's modes
    try:
        interpreter.setattr(autotune, "is_gpu", lambda device: True)
        interpreter.setattr(autotune, "benchmark", lambda fn: (fn(), 1.0)[1])
        check_runs(fused(str(cache), tune=True)[0])
    finally:
        os.umask(old)
    for directory in (cache, cache / "kernels", cache / "autotune"):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700, directory
    assert os.listdir(cache / "kernels") and os.listdir(cache / "autotune")


def test_group_writable_cache_dir_is_refused(interpreter, tmp_path):
    cache = tmp_path / "shared"
    cache.mkdir()
    os.chmod(cache, 0o777)
    with pytest.raises(OptionError, match=rf"{cache} is writable by group or others \(mode "
                                          r"0o777\).*chmod 700"):
        fused(str(cache))
    assert not (cache / "kernels").exists()
    assert issubclass(OptionError, ValueError)


def test_group_writable_kernels_dir_is_refused_at_load(interpreter, tmp_path):
    cache = tmp_path / "cache"
    gm, kernel = fused(str(cache))
    (cache / "kernels").mkdir(mode=0o700)
    os.chmod(cache / "kernels", 0o770)
    with pytest.raises(OptionError, match=rf"{cache / 'kernels'} is writable by group"):
        compile_cache.load_module(kernel.source, str(cache))


def test_cache_dir_of_another_user_is_refused(interpreter, tmp_path):
    cache = tmp_path / "theirs"
    cache.mkdir(mode=0o700)
    owner = os.stat(cache).st_uid
    interpreter.setattr(os, "getuid", lambda: owner + 4242)
    with pytest.raises(OptionError, match=rf"option cache_dir='{cache}': directory {cache} is "
                                          rf"owned by uid {owner}, not by you \(uid "
                                          rf"{owner + 4242}\).*set cache_dir to a directory"):
        fused(str(cache))


def _tuned_record(cache: str, kernel: FusedKernel) -> str:
    key = autotune.tune_key(kernel.ir, kernel.source_hash, torch.device("cpu"))
    return os.path.join(cache, "autotune", key.file_name())


def _sealed(key: dict, config: dict) -> str:
    """An autotune record as zeroc writes it (its checksum right) for ``key`` and ``config``."""
    fmt = autotune.RECORD_FORMAT
    return json.dumps({"zeroc_cache": "autotune", "format": fmt, "key": key, "data": config,
                       "sha256": checksum("autotune", fmt, key, config)})


@pytest.mark.parametrize("corruption", ["not json", "wrong fields", "other key", "bad config",
                                        "edited", "others can write"])
def test_corrupt_tuning_record_is_replaced(interpreter, tmp_path, caplog, corruption):
    cache = str(tmp_path / "cache")
    interpreter.setattr(autotune, "is_gpu", lambda device: True)
    times = iter([2.0, 1.0, 3.0, 4.0])
    interpreter.setattr(autotune, "benchmark", lambda fn: (fn(), next(times))[1])
    gm, kernel = fused(cache, tune=True)
    path = _tuned_record(cache, kernel)
    key = autotune.tune_key(kernel.ir, kernel.source_hash, torch.device("cpu")).to_json()
    good = {"BLOCK": 1024, "num_warps": 4}
    text = {
        "not json": "{not json",
        "wrong fields": json.dumps({"format": 1, "winner": good}),
        "other key": _sealed({**key, "device": "Other"}, good),
        "bad config": _sealed(key, {"BLOCK": 3}),
        "edited": _sealed(key, good).replace("1024", "2048"),
        "others can write": _sealed(key, good),
    }[corruption]
    os.makedirs(os.path.dirname(path), mode=0o700)
    with open(path, "w") as handle:
        handle.write(text)
    if corruption == "others can write":
        os.chmod(path, 0o666)
    with caplog.at_level(logging.WARNING, logger="zeroc"):
        check_runs(gm)
    assert "replaced" in caplog.text and path in caplog.text
    with open(path) as handle:
        record = json.load(handle)
    assert record == json.loads(_sealed(key, {"BLOCK": 512, "num_warps": 4}))
    assert kernel._config.to_json() == record["data"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
