"""Numerical parity of compiled zoo models with eager PyTorch on one device.

Each zoo model is trained for a few AdamW steps twice from the same initial state: once eager,
once through ``torch.compile(..., backend="zeroc")``. Losses, gradients, parameters and buffers
(BatchNorm running statistics) must agree at every step within fp32 tolerance.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from models.cnn import CNN, CNNConfig
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from models.mlp import MLP, MLPConfig
from parity import ADAM, ATOL, BATCH_SIZE, RTOL, STEPS, assert_tensors_match
from torch import nn

ZOO: dict[str, Callable[[], nn.Module]] = {
    "mlp_mse": lambda: MLP(MLPConfig(loss="mse"), seed=1),
    "mlp_cross_entropy": lambda: MLP(MLPConfig(loss="cross_entropy"), seed=2),
    "cnn_batchnorm": lambda: CNN(CNNConfig(), seed=3),
    "cnn_batchnorm_cumulative": lambda: CNN(CNNConfig(bn_momentum=None), seed=4),
    "gpt": lambda: GPT(GPTConfig.tiny(), seed=5),
    "llama": lambda: Llama(LlamaConfig.tiny(), seed=6),
}


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """The ``.grad`` of every parameter, by name."""
    return {name: p.grad for name, p in model.named_parameters()}


def params(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's value, by name."""
    return {name: p.detach() for name, p in model.named_parameters()}


def buffers(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every buffer, by name (persistent or not)."""
    return dict(model.named_buffers())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(ZOO))
def test_training_steps_match_eager(name: str, compile_backend: str) -> None:
    """Three AdamW steps: loss, grads, params and buffers equal eager after every step."""
    eager = ZOO[name]()
    module = copy.deepcopy(eager)
    compiled = torch.compile(module, backend=compile_backend)
    eager_opt = torch.optim.AdamW(eager.parameters(), **ADAM)
    compiled_opt = torch.optim.AdamW(module.parameters(), **ADAM)
    assert_tensors_match(params(eager), params(module), "initial param")

    for step in range(STEPS):
        inputs, targets = eager.example_batch(batch_size=BATCH_SIZE, seed=100 + step)
        eager_loss = eager(inputs, targets)
        compiled_loss = compiled(inputs, targets)
        assert compiled_loss.shape == eager_loss.shape == ()
        torch.testing.assert_close(
            compiled_loss, eager_loss, rtol=RTOL, atol=ATOL, msg=lambda m, s=step: f"loss {s}: {m}"
        )
        eager_loss.backward()
        compiled_loss.backward()
        assert_tensors_match(grads(eager), grads(module), f"step {step} grad")
        eager_opt.step()
        compiled_opt.step()
        eager_opt.zero_grad()
        compiled_opt.zero_grad()
        assert_tensors_match(params(eager), params(module), f"step {step} param")
        assert_tensors_match(
            buffers(eager), buffers(module), f"step {step} buffer", magnitude_scaled=False
        )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(ZOO))
def test_outputs_without_targets_match_eager(name: str, compile_backend: str) -> None:
    """``forward(x)`` without targets returns the same logits as eager, and their gradients."""
    eager = ZOO[name]()
    module = copy.deepcopy(eager)
    compiled = torch.compile(module, backend=compile_backend)
    inputs, _ = eager.example_batch(batch_size=BATCH_SIZE, seed=7)
    eager_out = eager(inputs)
    compiled_out = compiled(inputs)
    assert compiled_out.shape == eager_out.shape
    assert_tensors_match({"logits": eager_out}, {"logits": compiled_out}, "output")
    weights = torch.linspace(-1.0, 1.0, eager_out.numel()).view_as(eager_out)
    (eager_out * weights).sum().backward()
    (compiled_out * weights).sum().backward()
    assert_tensors_match(grads(eager), grads(module), "grad")
    assert_tensors_match(buffers(eager), buffers(module), "buffer", magnitude_scaled=False)


@pytest.mark.timeout(120)
def test_tied_head_stays_tied_through_compile(compile_backend: str) -> None:
    """GPT's head shares the embedding tensor; after compiled steps it still does, updated once."""
    eager = GPT(GPTConfig.tiny(), seed=8)
    module = copy.deepcopy(eager)
    compiled = torch.compile(module, backend=compile_backend)
    assert module.lm_head.weight is module.tok_emb.weight
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    inputs, targets = eager.example_batch(batch_size=BATCH_SIZE, seed=9)
    compiled(inputs, targets).backward()
    eager(inputs, targets).backward()
    optimizer.step()
    eager_optimizer.step()
    assert module.lm_head.weight is module.tok_emb.weight
    assert len(list(module.parameters())) == len(list(eager.parameters()))
    assert_tensors_match(params(eager), params(module), "param")
