"""Quantized gradient reduction (``options={"reduce_quant": "int8" | "int4"}``): the row
quantization against its error bound, error feedback carrying the rounding forward, the
plan of a CUDA job, and the option's refusals. Training on gloo ranks is in
``test_zero_compiled`` (pp=1) and ``test_pipeline_zero`` (the pipelines' per-step reductions).
"""

from __future__ import annotations

import types

import pytest
import torch
from models.gpt import GPT, GPTConfig

import zeroc
from zeroc.errors import OptionError
from zeroc.frontend.backend import _check_quantization
from zeroc.frontend.config import Config
from zeroc.runtime.quant import reduce as reduce_quant
from zeroc.runtime.quant.gather import BLOCK
from zeroc.runtime.quant.reduce import (
    DEQUANTIZE_SUM_MEAN,
    QUANTIZE_GRAD_ROWS,
    row_bytes,
    worth_quantizing,
)

LEVELS = {8: 127, 4: 7}


def rows_sent(packed: torch.Tensor, ranks: int, width: int, bits: int) -> torch.Tensor:
    """What each quantized row stands for: rank r's row alone, dequantized (float32)."""
    return torch.stack([DEQUANTIZE_SUM_MEAN(packed.view(ranks, -1)[r].repeat(1), packed, 1,
                                            width, bits, BLOCK, torch.float32)
                        for r in range(ranks)])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("width", [1, 255, 300, 1024])
def test_each_row_is_within_half_a_scale(bits: int, width: int) -> None:
    reduce_quant.reset_residuals()
    generator = torch.Generator().manual_seed(width)
    grads = torch.randn(3 * width, generator=generator)
    grads[:width // 2] = 0
    packed = QUANTIZE_GRAD_ROWS(grads, 3, bits, BLOCK, "bound")
    assert packed.dtype == torch.uint8 and packed.numel() == 3 * row_bytes(width, bits, BLOCK)
    got = rows_sent(packed, 3, width, bits)
    values = grads.view(3, width)
    blocks = -(-width // BLOCK)
    padded = torch.nn.functional.pad(values, (0, blocks * BLOCK - width)).view(3, blocks, BLOCK)
    scale = (padded.abs().amax(2) / LEVELS[bits]).repeat_interleave(BLOCK, 1)[:, :width]
    bound = scale / 2 + 2 * torch.finfo(torch.float32).eps * values.abs()
    assert bool(((got - values).abs() <= bound).all())
    assert bool((got[values == 0] == 0).all())
    # The received rows summed in float32 and averaged, in the gradient's dtype.
    mean = DEQUANTIZE_SUM_MEAN(packed, packed, 3, width, bits, BLOCK, torch.bfloat16)
    assert mean.dtype == torch.bfloat16 and torch.equal(mean, (got.sum(0) / 3).bfloat16())


@pytest.mark.parametrize("bits", [8, 4])
def test_error_feedback_carries_the_rounding_forward(bits: int) -> None:
    """Over 40 steps of small gradients with a common bias, what was sent sums to the true
    gradients' sum within one step's rounding; without the residual it drifts far more."""
    generator = torch.Generator().manual_seed(bits)
    steps = [torch.randn(2 * 512, generator=generator) * 0.01 + 0.002 for _ in range(40)]

    def drift(feedback: bool) -> float:
        reduce_quant.reset_residuals()
        sent = torch.zeros(2, 512)
        for grad in steps:
            if not feedback:
                reduce_quant.reset_residuals()
            sent += rows_sent(QUANTIZE_GRAD_ROWS(grad, 2, bits, BLOCK, "ef"), 2, 512, bits)
        return (sent - sum(steps).view(2, 512)).abs().max().item()

    with_feedback, without = drift(True), drift(False)
    one_step = max((g.view(2, -1).abs().amax() / LEVELS[bits]).item() for g in steps) / 2
    assert with_feedback <= one_step * 1.001
    assert without > 5 * with_feedback
    reduce_quant.reset_residuals()


def test_small_rows_are_reduced_exact() -> None:
    assert row_bytes(BLOCK * 100, 4, BLOCK) * 7.7 < BLOCK * 100 * 4
    assert row_bytes(BLOCK * 100, 8, BLOCK) * 3.9 < BLOCK * 100 * 4
    assert not worth_quantizing(16, 4, torch.float32, BLOCK)
    assert worth_quantizing(BLOCK, 4, torch.float32, BLOCK)


def test_option_values_and_refusals() -> None:
    assert Config.build(None, {"reduce_quant": "int4"}).reduce_quant == "int4"
    with pytest.raises(OptionError, match=r"reduce_quant='int2' is not allowed; allowed: "
                                          r"\[None, 'int8', 'int4'\]"):
        Config.build(None, {"reduce_quant": "int2"})

    def flat(zero: int, pp: int = 1) -> torch.nn.Parameter:
        param = torch.nn.Parameter(torch.zeros(2))
        param._zeroc_layout = types.SimpleNamespace(zero=zero, pp=pp)
        return param

    with pytest.raises(OptionError, match=r"reduce_quant='int8' quantizes the gradient "
                                          r"reduce-scatters of ZeRO-1, 2 and 3.*zero=0"):
        _check_quantization([flat(0)], Config.build(None, {"reduce_quant": "int8"}))
    with pytest.raises(OptionError, match=r"pp_reshard=False.*error-feedback"):
        _check_quantization([flat(3, pp=2)], Config.build(
            None, {"reduce_quant": "int4", "pp_reshard": True}))
    _check_quantization([flat(1)], Config.build(None, {"reduce_quant": "int4"}))
    _check_quantization([flat(3, pp=2)], Config.build(None, {"reduce_quant": "int4"}))


@pytest.mark.timeout(600)
def test_cuda_plan_reduces_int4_rows_by_all_to_all() -> None:
    """A 4-rank CUDA ZeRO-2 plan with int4 reductions: every bucket large enough to gain
    is quantized, sent by one all-to-all (NCCL's too) and dequantized and summed after its
    wait; the plan's bytes are the quantized rows'."""
    torch._dynamo.reset()
    batch = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    plans = {q: zeroc.explain(GPT(GPTConfig.tiny(), seed=0), (batch, batch), world=4,
                              zero=2, device="cuda", options={"reduce_quant": q})
             for q in (None, "int4")}
    reductions = {q: [c for c in p.collectives if c.op == "reduce_scatter"]
                  for q, p in plans.items()}
    assert [c.params for c in reductions["int4"]] == [c.params for c in reductions[None]]
    kinds = set()
    for exact, quant in zip(reductions[None], reductions["int4"], strict=True):
        width = exact.bytes // 4 // 4
        if quant.dtype == "int4":
            assert quant.bytes == 4 * row_bytes(width, 4, BLOCK) < exact.bytes
        else:
            assert quant.bytes == exact.bytes
        kinds.add(quant.dtype)
    assert "int4" in kinds
    code = plans["int4"].graph(next(g.name for g in plans["int4"].graphs
                                    if g.name.endswith("backward"))).code
    start = code.index("zeroc.quantize_grad_rows")
    assert start < code.index("all_to_all_single", start) < code.index(
        "zeroc.dequantize_sum_mean", start)
    gathers = {q: [(c.op, c.bytes) for c in p.collectives if c.op == "all_gather"]
               for q, p in plans.items()}
    assert gathers["int4"] == gathers[None]
