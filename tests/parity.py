"""Shared parity checks: compiled or distributed training against eager, fp32 tolerance.

Used by every test that compares a zeroc run with single-process eager PyTorch.
"""

from __future__ import annotations

from typing import Any

import torch

RTOL = 1e-5
ATOL = 1e-6
STEPS = 3
BATCH_SIZE = 4
# The key-projection bias has an exactly-zero true gradient (softmax is shift invariant), so its
# computed gradient is rounding noise of ~1e-10; Adam's default eps=1e-8 would scale that noise
# into updates of ~lr/100 that differ in sign between any two correct implementations.
ADAM = {"lr": 1e-3, "weight_decay": 0.01, "eps": 1e-6}


def train_losses(model: torch.nn.Module, run: Any, batches: Any) -> list[float]:
    """Train ``model`` with AdamW(``ADAM``), one step per ``(inputs, targets)`` batch, calling
    ``run`` (the model itself, or its compiled form) for the loss; every step's loss."""
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    losses = []
    for inputs, targets in batches:
        loss = run(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def assert_tensors_match(
    eager: dict[str, torch.Tensor | None],
    compiled: dict[str, torch.Tensor | None],
    what: str,
    magnitude_scaled: bool = True,
) -> None:
    """Every named tensor of ``compiled`` equals the one of ``eager`` within the fp32 tolerance.

    Elements are compared with ``rtol=1e-5`` and an absolute tolerance of 1e-5 of the tensor's
    largest magnitude (at least 1): elements near zero next to large ones may differ by
    reordered fp32 sums (and Adam's per-element normalisation of them), nothing more. A wrong
    gradient, a skipped update or a stale buffer is off by orders of magnitude more. With
    ``magnitude_scaled=False`` (buffers: BatchNorm statistics are plain momentum averages)
    the absolute tolerance is 1e-6.
    """
    assert eager.keys() == compiled.keys(), f"{what}: names differ"
    for name, expected in eager.items():
        actual = compiled[name]
        if expected is None or actual is None:
            assert expected is None and actual is None, f"{what} {name}: one side is None"
            continue
        if magnitude_scaled and expected.is_floating_point():
            atol = RTOL * max(1.0, expected.abs().max().item())
        else:
            atol = ATOL
        torch.testing.assert_close(
            actual,
            expected,
            rtol=RTOL,
            atol=atol,
            msg=lambda m, n=name: f"{what} {n}: {m}",
        )


def _full(grad: torch.Tensor | None) -> torch.Tensor | None:
    if grad is None:
        return None
    full_tensor = getattr(grad, "full_tensor", None)
    return (full_tensor() if callable(full_tensor) else grad).detach().clone()


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient by name, ``None`` where it has none; a DTensor's in full.

    A pipeline rank releases the parameters of other ranks' stages: those are left out (see
    ``merge_held``), so a missing gradient on a held parameter still shows as ``None``.
    """
    from zeroc.sharding.sharded_params import sharded_of

    out = {}
    for name, param in model.named_parameters():
        sharded = sharded_of(param)
        if sharded is not None and not sharded.held:
            continue
        out[name] = _full(param.grad)
    return out


def merge_held(per_rank: list[dict[str, torch.Tensor | None]]) -> dict[str, torch.Tensor | None]:
    """One gradient per parameter from the ranks' ``gradients``: a parameter held by several
    ranks (a tied one, a data-parallel replica) has the same gradient on each, so the first
    one that has a gradient stands for all."""
    merged: dict[str, torch.Tensor | None] = {}
    for grads in per_rank:
        for name, grad in grads.items():
            if merged.get(name) is None:
                merged[name] = grad
    return merged


def assert_gradients_match(eager: dict[str, torch.Tensor | None],
                           compiled: dict[str, torch.Tensor | None], what: str,
                           rtol: float = RTOL, atol: float | None = None) -> None:
    """The same parameters have a gradient as in eager, and each gradient equals eager's.

    A parameter eager gives a gradient and the compiled run does not (or the reverse) fails
    with its name, before any value is compared. ``atol``: absolute tolerance (default:
    ``rtol`` of the gradient's largest magnitude, at least ``rtol``).
    """
    assert eager.keys() == compiled.keys(), (
        f"{what}: parameters differ: {sorted(eager.keys() ^ compiled.keys())}")
    present = {n for n, g in eager.items() if g is not None}
    got = {n for n, g in compiled.items() if g is not None}
    assert present == got, (f"{what}: gradient only in eager: {sorted(present - got)}; "
                            f"only compiled: {sorted(got - present)}")
    for name in sorted(present):
        expected, actual = eager[name], compiled[name]
        tolerance = atol if atol is not None else rtol * max(1.0, expected.abs().max().item())
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=tolerance,
                                   msg=lambda m, n=name: f"{what} grad {n}: {m}")
