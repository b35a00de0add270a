"""Attention in a planned CUDA world takes the backend a GPU takes, not the math path.

``F.scaled_dot_product_attention`` asks a dispatch stub for its backend; a CPU-only torch has
no CUDA one, so fake CUDA tensors took the math path, which saves a (batch, heads, seq, seq)
score matrix per layer where a GPU's flash or memory-efficient kernel keeps the output and
one float per row (a Llama-7B step of 8 x 4096 tokens planned over 100 GiB a GPU and no
layout fit). ``zeroc.world.fake_cuda`` registers a CUDA choice that mimics torch's own on the
planned sm90 GPU while ``fake_cuda_planning`` is active. Checked: a bf16 causal model's
planned graphs use the flash forward and backward ops and its peak stays under one layer's
scores (the math path, asked for with ``sdpa_kernel``, plans more than all layers' scores);
the choice's rules, op by op (flash for fp16/bf16 without a mask, memory-efficient for fp32
or with a mask, math where neither fits or outside planning); a CPU planned world keeps
torch's CPU kernel.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import zeroc
from zeroc.runtime.torch_compat import FakeTensorMode, TorchDispatchMode
from zeroc.world.fake_cuda import ensure_fake_cuda, fake_cuda_planning

BATCH, SEQ, DIM, HEADS, LAYERS = 2, 1024, 64, 2, 2
# One layer's attention scores (and its probabilities, the same size) in bf16: what the math
# path keeps per layer for the backward.
SCORES = BATCH * HEADS * SEQ * SEQ * 2
FLASH = "aten._scaled_dot_product_flash_attention"
EFFICIENT = "aten._scaled_dot_product_efficient_attention"


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(o.transpose(1, 2).reshape(b, s, d))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(Attention() for _ in range(LAYERS)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).float().pow(2).mean()


def _plan(device: str):
    with torch.device("meta"):
        model = Model().to(torch.bfloat16)
    x = torch.zeros(BATCH, SEQ, DIM, dtype=torch.bfloat16)
    return zeroc.explain(model, (x,), world=2, zero=3, device=device)


def _targets(plan, name: str) -> list[str]:
    return [c.target for c in plan.graph(name).node_costs]


def test_a_planned_gpu_runs_flash_attention_and_keeps_no_scores() -> None:
    plan = _plan("cuda")
    forward, backward = _targets(plan, "g0.forward"), _targets(plan, "g0.backward")
    assert forward.count(f"{FLASH}.default") == LAYERS
    assert backward.count(f"{FLASH}_backward.default") == LAYERS
    assert not any("softmax" in t or t == "aten.bmm.default" for t in forward + backward)
    flops = [c.flops for c in plan.graph("g0.forward").node_costs
             if c.target == f"{FLASH}.default"]
    # torch.utils.flop_counter's formula: two (seq x seq x head_dim) products per head.
    assert flops == [4 * BATCH * HEADS * SEQ * SEQ * (DIM // HEADS)] * LAYERS
    peak = max(m.peak for m in plan.memory)
    assert peak < SCORES, peak
    with sdpa_kernel(SDPBackend.MATH):  # what the planned world did before: the math path
        math_peak = max(m.peak for m in _plan("cuda").memory)
    assert math_peak > LAYERS * SCORES > 2 * peak, (math_peak, peak)


def test_a_planned_cpu_keeps_the_cpu_kernel() -> None:
    targets = _targets(_plan("cpu"), "g0.forward") + _targets(_plan("cpu"), "g0.backward")
    assert not any(t.startswith((FLASH + ".", FLASH + "_backward", EFFICIENT)) for t in targets)
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in targets


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _backend(dtype: torch.dtype, head_dim: int = 32, mask: bool = False,
             causal: bool = True, kv_seq: int = 16, planning: bool = True) -> str:
    """The backend SDPA takes on fake CUDA tensors of (2, 4, 16, head_dim) queries."""
    ensure_fake_cuda()
    ops = _Ops()
    with fake_cuda_planning() if planning else contextlib.nullcontext(), FakeTensorMode():
        q = torch.empty(2, 4, 16, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        kv = torch.empty(2, 4, kv_seq, head_dim, device="cuda", dtype=dtype)
        attn_mask = torch.ones(16, kv_seq, device="cuda", dtype=torch.bool) if mask else None
        with ops:
            out = F.scaled_dot_product_attention(q, kv, kv, attn_mask=attn_mask,
                                                 is_causal=causal and not mask)
            if planning:  # outside, the autograd engine refuses CUDA tensors on this torch
                out.float().sum().backward()
    if f"{FLASH}.default" in ops.names:
        assert f"{FLASH}_backward.default" in ops.names
        return "flash"
    if f"{EFFICIENT}.default" in ops.names:
        assert f"{EFFICIENT}_backward.default" in ops.names
        return "efficient"
    return "math"


@pytest.mark.parametrize(("case", "expected"), [
    (dict(dtype=torch.bfloat16), "flash"),
    (dict(dtype=torch.float16, causal=False, kv_seq=24), "flash"),
    (dict(dtype=torch.bfloat16, mask=True), "efficient"),  # flash takes no mask
    (dict(dtype=torch.float32), "efficient"),  # flash takes fp16 and bf16 only
    (dict(dtype=torch.bfloat16, kv_seq=24), "efficient"),  # causal, not square: not flash
    (dict(dtype=torch.bfloat16, head_dim=512), "efficient"),  # flash: head_dim <= 256
    (dict(dtype=torch.float16, head_dim=12, mask=True), "math"),  # not a multiple of 8
    (dict(dtype=torch.float64), "math"),
    (dict(dtype=torch.bfloat16, planning=False), "math"),  # outside a planned world
])
def test_the_planned_gpu_chooses_as_torch_on_cuda_does(case: dict, expected: str) -> None:
    assert _backend(**case) == expected


def test_the_planned_choice_honours_the_enabled_backends() -> None:
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert _backend(torch.bfloat16) == "efficient"
    with sdpa_kernel(SDPBackend.MATH):
        assert _backend(torch.bfloat16) == "math"
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(RuntimeError, match="no enabled"):
        _backend(torch.float32)
