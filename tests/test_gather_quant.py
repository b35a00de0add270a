"""Quantized ZeRO gathers (``options={"gather_quant": "int8"}``): the kernels against their
error bound, the Triton kernels against the aten reference, the plan of a CUDA job, and the
option's refusals. Training on gloo ranks is in ``test_zero_compiled`` (pp=1) and
``test_pipeline_zero`` (the pipelines' per-step gathers).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from models.gpt import GPT, GPTConfig

import zeroc
from zeroc.errors import OptionError
from zeroc.frontend.config import Config
from zeroc.runtime.quant.gather import (
    BLOCK,
    DEQUANTIZE_INT8,
    QUANTIZE_INT8,
    packed_numel,
    quantized_bytes,
    worth_quantizing,
)


def block_scales(x: torch.Tensor) -> torch.Tensor:
    """Every element's block scale, max |x| / 127 over its block of BLOCK."""
    blocks = -(-x.numel() // BLOCK)
    padded = torch.nn.functional.pad(x.float(), (0, blocks * BLOCK - x.numel()))
    return (padded.view(blocks, BLOCK).abs().amax(1) / 127).repeat_interleave(BLOCK)[:x.numel()]


@pytest.mark.parametrize("numel", [1, 255, 256, 257, 3000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_blockwise_error_is_at_most_half_a_scale(numel: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(numel)
    shards = [torch.randn(numel, generator=generator).mul(10 ** (r - 1)).to(dtype)
              for r in range(3)]  # three ranks, three magnitudes
    shards[1][: numel // 2] = 0  # all-zero blocks stay exactly zero
    before = [s.clone() for s in shards]
    gathered = torch.cat([QUANTIZE_INT8([s], BLOCK) for s in shards])
    assert gathered.dtype == torch.uint8 and gathered.numel() == 3 * packed_numel(numel)
    assert quantized_bytes(numel, 3) == gathered.numel()
    out = DEQUANTIZE_INT8(gathered, [numel], BLOCK, torch.float32).view(3, numel)
    for shard, original, got in zip(shards, before, out, strict=True):
        assert torch.equal(shard, original)  # the master shard is never touched
        error = (got - shard.float()).abs()
        # scale / 2, plus float32's rounding of x / scale and of q * scale
        bound = block_scales(shard) / 2 + 2 * torch.finfo(torch.float32).eps * shard.float().abs()
        assert bool((error <= bound).all()), (error - bound).max()
        assert bool((got[shard == 0] == 0).all())
    # Into the compute dtype: the float32 value rounded once more.
    low = DEQUANTIZE_INT8(gathered, [numel], BLOCK, torch.bfloat16)
    assert low.dtype == torch.bfloat16 and torch.equal(low, out.reshape(-1).bfloat16())


def test_a_bucket_is_quantized_as_one_buffer_and_unpacked_per_parameter() -> None:
    """Three parameters' shards on two ranks: one packed buffer per rank (blocks run across
    the small shards), and each parameter's gathered buffer comes out contiguous, rank-major,
    as the unquantized coalesced gather writes it."""
    widths = [16, 300, 5]
    generator = torch.Generator().manual_seed(3)
    ranks = [[torch.randn(w, generator=generator) for w in widths] for _ in range(2)]
    packed = [QUANTIZE_INT8(shards, BLOCK) for shards in ranks]
    assert packed[0].numel() == packed_numel(sum(widths)) == 512 + 8
    out = DEQUANTIZE_INT8(torch.cat(packed), widths, BLOCK, torch.float32)
    offset = 0
    for index, width in enumerate(widths):
        exact = torch.cat([ranks[0][index], ranks[1][index]])
        got = out[offset : offset + 2 * width]
        offset += 2 * width
        joined = [torch.cat(shards) for shards in ranks]
        bound = torch.cat([block_scales(j)[sum(widths[:index]):sum(widths[:index + 1])]
                           for j in joined]) / 2 + 1e-6
        assert bool(((got - exact).abs() <= bound).all()), index


def test_int8_blocks_of_a_float32_shard_take_a_quarter_of_the_bytes() -> None:
    assert packed_numel(BLOCK * 1000) == BLOCK * 1000 + 4 * 1000
    assert 4 * BLOCK * 1000 / packed_numel(BLOCK * 1000) == pytest.approx(3.94, abs=0.01)
    # Under a block's worth a bucket is gathered exact: int8 would move more.
    assert not worth_quantizing(32, torch.float32) and worth_quantizing(66, torch.float32)
    assert not worth_quantizing(129, torch.bfloat16) and worth_quantizing(131, torch.bfloat16)


def test_quantize_refuses_integer_shards() -> None:
    with pytest.raises(TypeError, match="gather_quant='int8'.*floating-point"):
        QUANTIZE_INT8([torch.arange(10)], BLOCK)


TRITON_CHECK = textwrap.dedent("""
    import torch
    from zeroc.runtime.quant import gather as gq
    generator = torch.Generator().manual_seed(0)
    for widths in ([1], [256], [257], [1500], [16, 300, 5, 700]):
        ranks = [[torch.randn(w, generator=generator) * 3 for w in widths] for _ in range(2)]
        ranks[0][0][:300] = 0
        for kernel in ("torch", "triton"):
            gq.os.environ[gq.KERNEL_ENV] = kernel
            assert gq.kernel_for(torch.device("cpu")) == kernel
            packed = torch.cat([gq.QUANTIZE_INT8(shards, gq.BLOCK) for shards in ranks])
            out = {d: gq.DEQUANTIZE_INT8(packed, widths, gq.BLOCK, d)
                   for d in (torch.float32, torch.bfloat16)}
            if kernel == "torch":
                ref_packed, ref_out = packed, out
        assert torch.equal(packed, ref_packed), widths
        assert torch.equal(out[torch.float32], ref_out[torch.float32]), widths
        # bfloat16: the interpreter may round the float32 value to bfloat16 otherwise than
        # aten's round-to-nearest-even: at most one bfloat16 step apart
        torch.testing.assert_close(out[torch.bfloat16], ref_out[torch.bfloat16],
                                   rtol=2 ** -7, atol=0)
    print("triton kernels equal the aten reference")
""")


@pytest.mark.timeout(300)
def test_triton_kernels_equal_the_aten_reference() -> None:
    """The CUDA path's Triton kernels, run by Triton's interpreter, write the same bytes and
    values as the aten path (a child process: Triton reads TRITON_INTERPRET at import)."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True,
                          text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "equal the aten reference" in done.stdout


def test_option_values() -> None:
    assert Config.build(None, {"gather_quant": "int8"}).gather_quant == "int8"
    assert Config.build(None, {}).gather_quant is None
    with pytest.raises(OptionError, match=r"gather_quant='int4' is not allowed; allowed: "
                                          r"\[None, 'int8'\]"):
        Config.build(None, {"gather_quant": "int4"})


def tokens() -> torch.Tensor:
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.timeout(600)
def test_cuda_plan_gathers_int8_and_counts_its_bytes() -> None:
    """A 4-rank CUDA ZeRO-3 plan: every gather moves int8 blocks and scales (the plan's
    bytes are the packed buffers'), the graphs quantize before the gather and dequantize
    after its wait, and the reductions are unchanged."""
    torch._dynamo.reset()
    batch = tokens()
    plans = {q: zeroc.explain(GPT(GPTConfig.tiny(), seed=0), (batch, batch), world=4,
                              zero=3, device="cuda", options={"gather_quant": q})
             for q in (None, "int8")}
    gathers = {q: [c for c in p.collectives if c.op == "all_gather"] for q, p in plans.items()}
    assert [c.params for c in gathers["int8"]] == [c.params for c in gathers[None]]
    shapes = {n: p.shape for n, p in GPT(GPTConfig.tiny(), seed=0).named_parameters()}
    kinds = set()
    for exact, quant in zip(gathers[None], gathers["int8"], strict=True):
        # A shard: ceil(rows / 4) rows of the parameter (ZeRO-3 pads the last rank's).
        numel = sum(-(-shapes[n][0] // 4) * shapes[n][1:].numel() for n in quant.params)
        if worth_quantizing(numel, torch.float32):
            assert quant.dtype == "int8" and quant.bytes == quantized_bytes(numel, 4)
            assert quant.bytes < exact.bytes
        else:  # e.g. the final layer norm: 32 elements per rank, under a block's worth
            assert quant.dtype == "float32" and quant.bytes == exact.bytes == 4 * 4 * numel
        kinds.add(quant.dtype)
    assert kinds == {"int8", "float32"}
    reductions = {q: [(c.op, c.bytes) for c in p.collectives if c.op != "all_gather"]
                  for q, p in plans.items()}
    assert reductions["int8"] == reductions[None]
    code = plans["int8"].graph(next(g.name for g in plans["int8"].graphs
                                    if g.name.endswith("forward"))).code
    quantize = code.index("zeroc.quantize_int8")
    assert quantize < code.index("all_gather_into_tensor") < code.index("wait_tensor") \
        < code.index("zeroc.dequantize_int8")
    assert re.search(r"gather_quant\W+'?int8", str(plans["int8"].full()))


def test_gather_quant_refused_where_nothing_is_gathered() -> None:
    torch._dynamo.reset()
    batch = tokens()
    model = zeroc.parallelize(GPT(GPTConfig.tiny(), seed=0), zero=1)
    compiled = torch.compile(model, backend="zeroc", options={"gather_quant": "int8"})
    with pytest.raises(OptionError, match=r"gather_quant='int8' quantizes the parameter "
                                          r"all-gathers of ZeRO-2 and ZeRO-3.*zero=1, which "
                                          r"runs none"):
        compiled(batch, batch)
    torch._dynamo.reset()
    plain = torch.compile(GPT(GPTConfig.tiny(), seed=0), backend="zeroc",
                          options={"gather_quant": "int8"})
    with pytest.raises(OptionError, match="was not parallelized"):
        plain(batch, batch)
