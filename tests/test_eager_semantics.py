"""A model compiled with zeroc behaves like eager PyTorch in the places users trip over.

Graph breaks (several graphs per call), recompiles on new shapes, buffers mutated in forward,
``torch.no_grad``/``torch.inference_mode``, and ``train()``/``eval()`` switches for BatchNorm and
dropout. The reference is always the same model run eagerly.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from models.cnn import CNN, CNNConfig
from models.gpt import GPT, GPTConfig
from models.mlp import MLP, MLPConfig
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

RTOL = 1e-5
ATOL = 1e-6
# One block is enough to exercise every op of the GPT; compile time grows with depth.
ONE_BLOCK_GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=32)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """fp32 parity with a message naming what differs."""
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def assert_same_grads_and_buffers(eager: nn.Module, compiled: nn.Module) -> None:
    """Every parameter's gradient and every buffer of ``compiled`` equals eager's."""
    for (name, expected), (_, actual) in zip(
        eager.named_parameters(), compiled.named_parameters(), strict=True
    ):
        assert (expected.grad is None) == (actual.grad is None), f"grad of {name}"
        if expected.grad is not None:
            assert_close(actual.grad, expected.grad, f"grad of {name}")
    for (name, expected), (_, actual) in zip(
        eager.named_buffers(), compiled.named_buffers(), strict=True
    ):
        assert_close(actual, expected, f"buffer {name}")


class GraphBreakMLP(nn.Module):
    """Two linear layers with an explicit graph break between them."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``second(gelu(first(x)))`` split into two graphs."""
        hidden = F.gelu(self.first(x))
        torch._dynamo.graph_break()
        return self.second(hidden)


class PrintingMLP(GraphBreakMLP):
    """Prints the batch size mid-forward: a side effect Dynamo runs outside the graphs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``second(gelu(first(x)))`` with a print between the layers."""
        hidden = F.gelu(self.first(x))
        print(f"hidden batch {hidden.shape[0]}")
        return self.second(hidden)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_cls", [GraphBreakMLP, PrintingMLP])
def test_graph_break_gives_several_graphs_matching_eager(
    model_cls: type[nn.Module], compile_backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A forward split by a graph break compiles into >1 graph; forward and backward match."""
    eager = model_cls()
    module = copy.deepcopy(eager)
    counter = CompileCounterWithBackend(compile_backend)
    compiled = torch.compile(module, backend=counter)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    target = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))

    expected = eager(x)
    eager_printed = capsys.readouterr().out
    actual = compiled(x)
    compiled_printed = capsys.readouterr().out
    assert counter.frame_count >= 2, f"expected a graph break, got {counter.frame_count} graph(s)"
    assert compiled_printed == eager_printed
    assert_close(actual, expected, "output")
    F.mse_loss(expected, target).backward()
    F.mse_loss(actual, target).backward()
    assert_same_grads_and_buffers(eager, module)


@pytest.mark.timeout(120)
def test_new_batch_sizes_recompile_and_match_eager(compile_backend: str) -> None:
    """Batch sizes 2, 4, 3: each call matches eager; the second size triggers a new compile."""
    eager = MLP(MLPConfig(), seed=3)
    module = copy.deepcopy(eager)
    counter = CompileCounterWithBackend(compile_backend)
    compiled = torch.compile(module, backend=counter)
    frames = []
    for step, batch in enumerate((2, 4, 3)):
        inputs, targets = eager.example_batch(batch_size=batch, seed=step)
        expected, actual = eager(inputs, targets), compiled(inputs, targets)
        assert_close(actual, expected, f"loss at batch {batch}")
        expected.backward()
        actual.backward()
        assert_same_grads_and_buffers(eager, module)
        frames.append(counter.frame_count)
    assert frames[0] == 1
    assert frames[1] == 2, f"no recompile for a new batch size: graph counts {frames}"


@pytest.mark.timeout(120)
def test_new_sequence_lengths_match_eager(compile_backend: str) -> None:
    """GPT with sequence lengths 16, 11, 9, 7 (positions sliced by length) matches eager.

    As with aot_eager, the second length compiles a graph with a dynamic length, which then
    serves every later length without another compile.
    """
    eager = GPT(ONE_BLOCK_GPT, seed=4)
    module = copy.deepcopy(eager)
    compiled = torch.compile(module, backend=compile_backend)
    torch._dynamo.utils.counters.clear()
    for step, seq_len in enumerate((16, 11, 9, 7)):
        inputs, targets = eager.example_batch(batch_size=2, seq_len=seq_len, seed=step)
        expected, actual = eager(inputs, targets), compiled(inputs, targets)
        assert_close(actual, expected, f"loss at length {seq_len}")
        expected.backward()
        actual.backward()
        assert_same_grads_and_buffers(eager, module)
        eager.zero_grad()
        module.zero_grad()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bn_momentum", [0.1, None])
def test_batchnorm_running_stats_follow_eager(
    bn_momentum: float | None, compile_backend: str
) -> None:
    """Train-mode forwards update running_mean/var and num_batches_tracked exactly as eager.

    Forwards under ``torch.no_grad`` in train mode update the statistics too.
    """
    eager = CNN(CNNConfig(bn_momentum=bn_momentum), seed=5)
    module = copy.deepcopy(eager)
    compiled = torch.compile(module, backend=compile_backend)
    bn = module.layers[0].bn
    initial_mean = bn.running_mean.clone()
    for step in range(3):
        inputs, targets = eager.example_batch(batch_size=4, seed=step)
        eager(inputs, targets).backward()
        compiled(inputs, targets).backward()
        assert_same_grads_and_buffers(eager, module)
    assert int(bn.num_batches_tracked) == 3
    assert not torch.equal(bn.running_mean, initial_mean)
    with torch.no_grad():
        inputs, _ = eager.example_batch(batch_size=4, seed=10)
        assert_close(compiled(inputs), eager(inputs), "no_grad train-mode logits")
    assert int(bn.num_batches_tracked) == 4
    assert_same_grads_and_buffers(eager, module)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "grad_mode", [torch.no_grad, torch.inference_mode], ids=lambda f: f.__name__
)
def test_grad_disabled_modes_match_eager(
    grad_mode: Callable[[], object], compile_backend: str
) -> None:
    """Under no_grad / inference_mode: same logits and loss, nothing requires grad, no grads."""
    eager = GPT(ONE_BLOCK_GPT, seed=6)
    module = copy.deepcopy(eager)
    compiled = torch.compile(module, backend=compile_backend)
    inputs, targets = eager.example_batch(batch_size=2, seed=0)
    with grad_mode():
        expected_logits, actual_logits = eager(inputs), compiled(inputs)
        expected_loss, actual_loss = eager(inputs, targets), compiled(inputs, targets)
    assert_close(actual_logits, expected_logits, "logits")
    assert_close(actual_loss, expected_loss, "loss")
    for tensor in (actual_logits, actual_loss):
        assert not tensor.requires_grad
        assert tensor.grad_fn is None
    assert actual_loss.is_inference() == expected_loss.is_inference()
    assert all(p.grad is None for p in module.parameters())
    # Grad mode back on: the same compiled model trains again, matching eager.
    expected, actual = eager(inputs, targets), compiled(inputs, targets)
    assert actual.requires_grad
    expected.backward()
    actual.backward()
    assert_same_grads_and_buffers(eager, module)


@pytest.mark.timeout(120)
def test_train_eval_switches_match_eager_batchnorm(compile_backend: str) -> None:
    """train -> eval -> train -> eval: BN uses batch stats or running stats exactly as eager."""
    eager = CNN(CNNConfig(), seed=7)
    module = copy.deepcopy(eager)
    compiled = torch.compile(module, backend=compile_backend)
    for step, training in enumerate((True, False, True, False)):
        eager.train(training)
        compiled.train(training)
        assert module.training == training
        inputs, targets = eager.example_batch(batch_size=4, seed=step)
        expected, actual = eager(inputs, targets), compiled(inputs, targets)
        assert_close(actual, expected, f"loss in {'train' if training else 'eval'} mode")
        expected.backward()
        actual.backward()
        assert_same_grads_and_buffers(eager, module)
    assert int(module.layers[0].bn.num_batches_tracked) == 2


class DropoutScale(nn.Module):
    """``dropout(x * weight)``: a parameter before dropout, so gradients reveal the mask."""

    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Scale each feature, then drop."""
        return self.dropout(x * self.weight)


@pytest.mark.timeout(120)
def test_dropout_train_drops_and_eval_is_identity(compile_backend: str) -> None:
    """Train: outputs are 0 or scaled by 1/(1-p), about p dropped, grads follow the mask.

    Eval: dropout is the identity, equal to eager.
    """
    p = 0.5
    module = DropoutScale(64, p)
    compiled = torch.compile(module, backend=compile_backend)
    x = torch.rand(128, 64, generator=torch.Generator().manual_seed(0)) + 0.5
    scaled = (x * module.weight).detach()

    out = compiled(x)
    kept = out != 0
    drop_fraction = 1.0 - kept.float().mean().item()
    assert 0.4 < drop_fraction < 0.6, f"dropped {drop_fraction:.3f} of elements with p={p}"
    assert_close(out[kept], scaled[kept] / (1 - p), "kept elements")
    out.sum().backward()
    expected_grad = (kept.float() * x / (1 - p)).sum(0)
    assert_close(module.weight.grad, expected_grad, "weight grad through the dropout mask")
    assert not torch.equal(compiled(x), out), "two train-mode calls drew the same mask"

    module.eval()
    assert_close(compiled(x), scaled, "eval-mode output")


@pytest.mark.timeout(120)
def test_gpt_with_dropout_in_eval_matches_eager(compile_backend: str) -> None:
    """A GPT configured with dropout gives eager's logits in eval mode (attention dropout off)."""
    config = dataclasses.replace(ONE_BLOCK_GPT, dropout=0.2)
    eager = GPT(config, seed=8).eval()
    module = copy.deepcopy(eager)
    compiled = torch.compile(module, backend=compile_backend)
    inputs, targets = eager.example_batch(batch_size=2, seed=0)
    assert_close(compiled(inputs), eager(inputs), "eval logits")
    expected, actual = eager(inputs, targets), compiled(inputs, targets)
    assert_close(actual, expected, "eval loss")
    expected.backward()
    actual.backward()
    assert_same_grads_and_buffers(eager, module)
    module.train()
    # At initialization the logits are near zero, so dropout moves the loss only slightly:
    # compare the logits, which dropout changes element by element.
    train_logits, eval_logits = compiled(inputs), eager(inputs)
    assert not torch.equal(train_logits, eval_logits), "train-mode dropout changed nothing"
    dropped = (train_logits - eval_logits).abs() > 1e-6
    assert dropped.float().mean() > 0.5, "train-mode dropout changed almost nothing"
