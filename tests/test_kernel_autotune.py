"""``kernel_autotune``: off launches one default config untimed; on tunes once and persists.

Kernels are zeroc's own (``kernels="triton"``), launched on CPU tensors by the Triton
interpreter. The GPU check (``autotune.is_gpu``) is patched to say "GPU" so the GPU rules run,
the GPU's name is patched to a fake one, and the timer (``autotune.benchmark``, which wraps
``triton.testing.do_bench``) is replaced by a fake one that runs the launch and returns
planned times, or by one that fails the test when called. The kernel is a pointwise
``x * 2 + 1``: its source calls no Triton library function, so it interprets in this process.
"""

from __future__ import annotations

import json
import os
import types

import pytest
import torch
import triton.testing
from torch.fx.experimental.proxy_tensor import make_fx

import zeroc
from zeroc.codegen import autotune, compile_cache
from zeroc.codegen.fused_kernel import FusedKernel
from zeroc.frontend.config import Config
from zeroc.passes.base import PassContext
from zeroc.passes.fusion import fusion
from zeroc.runtime.plan.plan import Plan, launched

FAKE_GPU = "Fake GPU 9000"
# The fake timer's milliseconds for the pointwise candidates, in their order: the third wins.
TIMES = [3.0, 2.0, 1.0, 4.0]


def affine(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0 + 1.0


@pytest.fixture
def fake_gpu(monkeypatch):
    """The interpreter, fresh in-memory caches, a "GPU" with a fake name, and no real timer."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(compile_cache, "_modules", {})
    monkeypatch.setattr(autotune, "_memory", {})
    monkeypatch.setattr(autotune, "is_gpu", lambda device: True)
    monkeypatch.setattr(autotune, "device_name", lambda device: FAKE_GPU)

    def no_timing(*args, **kwargs):
        raise AssertionError("a timing function was called")

    monkeypatch.setattr(triton.testing, "do_bench", no_timing)
    monkeypatch.setattr(autotune, "benchmark", no_timing)
    return monkeypatch


def fake_timer(monkeypatch) -> list[float]:
    """Install a timer that runs each launch once and returns ``TIMES`` in turn; returns the
    list of times it handed out."""
    handed: list[float] = []

    def timer(fn):
        fn()
        handed.append(TIMES[len(handed) % len(TIMES)])
        return handed[-1]

    monkeypatch.setattr(autotune, "benchmark", timer)
    return handed


def fused(cache_dir: str, tune: bool, shape=(30, 16)):
    """(graph module, its FusedKernel, its KernelInfo) for ``affine`` at ``shape``."""
    gm = make_fx(affine, tracing_mode="fake")(torch.randn(shape))
    config = types.SimpleNamespace(kernels="triton", cache_dir=cache_dir, kernel_autotune=tune)
    ctx = PassContext(config, "g0.inference", "inference")
    result = fusion(gm, ctx)
    [kernel] = [n.target for n in result.gm.graph.nodes if isinstance(n.target, FusedKernel)]
    return result.gm, kernel, ctx.kernels[0]


def records(cache_dir: str) -> list[dict]:
    directory = os.path.join(cache_dir, "autotune")
    if not os.path.isdir(directory):
        return []
    return [json.load(open(os.path.join(directory, f))) for f in sorted(os.listdir(directory))]


def test_autotune_off_launches_the_default_without_timing(fake_gpu, tmp_path):
    gm, kernel, info = fused(str(tmp_path), tune=False)
    x = torch.randn(30, 16)
    torch.testing.assert_close(gm(x), affine(x))
    default = autotune.gpu_candidates(kernel.ir)[0]
    assert kernel._config == default and records(str(tmp_path)) == []
    assert launched(info).block == tuple(default.to_json().items())


def test_autotune_on_persists_the_winner_and_reuses_it(fake_gpu, tmp_path):
    cache = str(tmp_path)
    handed = fake_timer(fake_gpu)
    gm, kernel, info = fused(cache, tune=True)
    x = torch.randn(30, 16)
    torch.testing.assert_close(gm(x), affine(x))
    candidates = autotune.gpu_candidates(kernel.ir)
    assert handed == TIMES and kernel._config == candidates[2]
    [record] = records(cache)
    assert record["key"] == {"source_hash": info.source_hash, "device": FAKE_GPU,
                             "dtypes": "float32->float32", "shape_class": "n512"}
    assert record["data"] == {"BLOCK": 2048, "num_warps": 8}
    assert launched(info).block == (("BLOCK", 2048), ("num_warps", 8))

    # A fresh process-level cache (memory emptied, new kernel object) reads the record and
    # never times; so does another size of the same shape class (32 x 16 = 512 elements).
    autotune.clear_memory_cache()
    fake_gpu.setattr(autotune, "benchmark", lambda fn: pytest.fail("timed again"))
    for shape in ((30, 16), (32, 16)):
        gm, kernel, _ = fused(cache, tune=True, shape=shape)
        x = torch.randn(shape)
        torch.testing.assert_close(gm(x), affine(x))
        assert kernel._config == candidates[2]
    assert len(records(cache)) == 1


def test_another_shape_class_or_device_tunes_again(fake_gpu, tmp_path):
    cache = str(tmp_path)
    handed = fake_timer(fake_gpu)
    fused(cache, tune=True)[0](torch.randn(30, 16))
    fused(cache, tune=True, shape=(64, 16))[0](torch.randn(64, 16))  # n1024
    fake_gpu.setattr(autotune, "device_name", lambda device: "Other GPU")
    fused(cache, tune=True)[0](torch.randn(30, 16))
    assert len(handed) == 3 * len(TIMES)
    keys = sorted((r["key"]["device"], r["key"]["shape_class"]) for r in records(cache))
    assert keys == [(FAKE_GPU, "n1024"), (FAKE_GPU, "n512"), ("Other GPU", "n512")]


def test_off_a_gpu_the_interpreter_tile_is_launched_and_shown(fake_gpu, tmp_path):
    fake_gpu.setattr(autotune, "is_gpu", lambda device: False)
    gm, kernel, info = fused(str(tmp_path), tune=True)
    gm(torch.randn(30, 16))
    tile = autotune.interpreter_config(kernel.ir)
    assert tile.as_kwargs() == {"BLOCK": 512}
    assert info.block == launched(info).block == tuple(tile.to_json().items())
    assert records(str(tmp_path)) == []


def test_max_autotune_mode_reaches_the_kernels(fake_gpu, tmp_path):
    """``mode="max-autotune"`` turns ``kernel_autotune`` on, and the fusion pass reads it from
    the Config (``torch.compile`` takes a mode or options, not both, so the Config is built
    here as ``zeroc_backend`` builds it)."""
    assert Config.build().kernel_autotune is False
    config = Config.build("max-autotune", {"kernels": "triton", "cache_dir": str(tmp_path)})
    assert config.kernel_autotune is True
    handed = fake_timer(fake_gpu)
    gm = make_fx(affine, tracing_mode="fake")(torch.randn(30, 16))
    ctx = PassContext(config, "g0.inference", "inference")
    result = fusion(gm, ctx)
    x = torch.randn(30, 16)
    torch.testing.assert_close(result.gm(x), affine(x))
    assert handed == TIMES
    assert launched(ctx.kernels[0]).block == (("BLOCK", 2048), ("num_warps", 8))


def test_autotune_option_through_torch_compile_shows_the_winner(fake_gpu, tmp_path):
    handed = fake_timer(fake_gpu)
    compiled = torch.compile(affine, backend="zeroc", options={
        "kernels": "triton", "cache_dir": str(tmp_path), "kernel_autotune": True})
    x = torch.randn(30, 16)
    torch.testing.assert_close(compiled(x), affine(x))
    assert handed == TIMES
    plan = zeroc.explain(compiled)
    [info] = plan.kernels
    assert info.block == (("BLOCK", 2048), ("num_warps", 8))
    assert "BLOCK=2048 warps=8" in str(plan)
    assert Plan.from_json(plan.to_json()) == plan


def test_default_options_never_time(fake_gpu, tmp_path):
    compiled = torch.compile(affine, backend="zeroc",
                             options={"kernels": "triton", "cache_dir": str(tmp_path)})
    x = torch.randn(30, 16)
    torch.testing.assert_close(compiled(x), affine(x))
    [info] = zeroc.explain(compiled).kernels
    assert info.block == (("BLOCK", 1024), ("num_warps", 4))
    assert records(str(tmp_path)) == []
