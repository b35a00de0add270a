"""The cases of ``tests/test_hf_moe.py``: layouts, the eager reference and each rank's run.

A case is ``(model name, layout name)``. Every layout trains ``STEPS`` AdamW steps of a
Hugging Face model from ``tests/models/hf.py`` called with ``labels=`` and records, per rank,
the step losses, the gradients after the first backward (only those the rank holds, gathered
whole: ``full_tensor()`` for a ZeRO-3 DTensor) and the parameters after the last step. The
reference is single-process eager on the global batch, or, for a loss that is not a mean over
tokens (``PER_SLICE``: Qwen3-MoE's loss includes the router's load-balancing loss, a product
of two batch means), the mean over the slices each step of the layout computes the loss on
(each data-parallel replica's micro-batches), which is what training on that layout means.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from models.hf import build, token_batch
from parity import ADAM

import zeroc

STEPS = 2
SEQ = 16
# Models whose loss is averaged over the slices it is computed on (zeroc cannot and does not
# combine it exactly over micro-batches: loss_reduction="mean" says so).
PER_SLICE = frozenset({"qwen3_moe"})
# Training labels ignored at random where the reference is the global batch (one process and
# the pipelines without data parallelism): a token mean must divide by the whole batch's count.
IGNORED = 0.3


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a case is run: ranks, ZeRO stage, pipeline degree and schedule, global batch."""

    world: int
    zero: int | None  # None: no parallelize, one process compiled with backend="zeroc"
    pp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 4
    batch: int = 8
    # Decoder layers: two (pp=2 with 1F1B puts one in each stage). Dynamo's trace of a model
    # grows with its layers, and these cases are among the suite's slowest.
    layers: int = 2

    @property
    def dp(self) -> int:
        return self.world // self.pp

    def slices(self, name: str) -> int:
        """Equal parts of the batch the reference loss averages over."""
        return self.dp * (self.microbatches if self.pp > 1 else 1) if name in PER_SLICE else 1

    def ignored(self, name: str) -> float:
        return IGNORED if self.dp == 1 and name not in PER_SLICE else 0.0


LAYOUTS = {
    "compiled": Layout(world=1, zero=None),
    "zero3": Layout(world=2, zero=3),
    "1f1b": Layout(world=2, zero=0, pp=2, schedule="1f1b"),
    "pp2xdp2": Layout(world=4, zero=3, pp=2, schedule="1f1b", batch=16),
}


def batch(name: str, layout: Layout, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``."""
    return token_batch(layout.batch, SEQ, seed=step, ignored=layout.ignored(name))


def make_model(name: str, layers: int = 2, **config: Any) -> torch.nn.Module:
    """``build(name, layers)`` under seed 0, with ``config`` set on its config before the
    build."""
    torch.manual_seed(0)
    model = build(name, layers)
    if config:
        for key, value in config.items():
            setattr(model.config, key, value)
        torch.manual_seed(0)
        model = type(model)(model.config)
    return model


def eager_reference(name: str, layout: Layout) -> dict:
    """Single-process eager: the step losses, first gradients and final parameters."""
    model = make_model(name, layout.layers)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    parts = layout.slices(name)
    losses, grads = [], {}
    for step in range(STEPS):
        ids, labels = batch(name, layout, step)
        loss = sum(model(input_ids=i, labels=t).loss
                   for i, t in zip(ids.chunk(parts), labels.chunk(parts), strict=True)) / parts
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _held(tensor: torch.Tensor) -> bool:
    """A pipeline rank holds it (released parameters are meta DTensors or empty tensors)."""
    local = getattr(tensor, "_local_tensor", tensor)
    return not local.is_meta and tensor.numel() > 0


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().clone()


def compile_case(name: str, layout: Layout, model: torch.nn.Module):
    """``model`` parallelized for ``layout`` (in place) and compiled with zeroc."""
    if layout.zero is None:
        return torch.compile(model, backend="zeroc")
    zeroc.parallelize(model, zero=layout.zero, pp=layout.pp)
    options = {}
    if layout.pp > 1:
        options = {"schedule": layout.schedule, "microbatches": layout.microbatches}
        if name in PER_SLICE:
            options["loss_reduction"] = "mean"
    return torch.compile(model, backend="zeroc", options=options)


def run_case(rank: int, name: str, layout: Layout) -> dict:
    """This rank's run of the case: its losses, held first gradients, held final params."""
    torch._dynamo.reset()
    model = make_model(name, layout.layers)
    compiled = compile_case(name, layout, model)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    replica = rank % layout.dp  # rank r: pipeline position r // dp, data-parallel index r % dp
    losses, grads = [], {}
    for step in range(STEPS):
        ids, labels = batch(name, layout, step)
        loss = compiled(input_ids=ids.chunk(layout.dp)[replica],
                        labels=labels.chunk(layout.dp)[replica]).loss
        loss.backward()
        if step == 0:  # every rank of a data-parallel group walks the same parameters
            grads = {n: _whole(p.grad) for n, p in model.named_parameters()
                     if p.grad is not None and _held(p)}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "grads": grads,
            "params": {n: _whole(p) for n, p in model.named_parameters() if _held(p)}}


def check_case(ranks: list[dict], name: str, layout: Layout, expected: dict) -> None:
    """The ranks' run of a case equals ``expected`` (``eager_reference``)."""
    what = f"{name} {layout}"
    pipelined = layout.pp > 1
    rtol, atol = (1e-4, 1e-5) if pipelined else (1e-5, 1e-6)
    # Each replica's loss, read on the ranks of pipeline position 0; their mean is the step's.
    losses = [sum(r["losses"][s] for r in ranks[:layout.dp]) / layout.dp for s in range(STEPS)]
    assert losses == pytest.approx(expected["losses"], rel=1e-5), (what, expected["losses"])
    for index, rank in enumerate(ranks):  # the ranks of one pipeline report one loss
        assert rank["losses"] == ranks[index % layout.dp]["losses"], (what, index)
    grads = {n: g for r in ranks for n, g in r["grads"].items()}
    assert set(grads) == set(expected["grads"]), (what, set(grads) ^ set(expected["grads"]))
    held = {n: p for r in ranks for n, p in r["params"].items()}
    assert set(held) == set(expected["params"]), (what, set(held) ^ set(expected["params"]))
    for kind, values in (("grads", grads), ("params", held)):
        for key, want in expected[kind].items():
            scale = max(1.0, want.abs().max().item())
            torch.testing.assert_close(values[key], want, rtol=rtol, atol=atol * scale,
                                       msg=lambda m, k=key, w=kind: f"{what} {w} {k}: {m}")

