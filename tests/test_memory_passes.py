"""The two passes that cut activation memory: the fused linear cross-entropy and recompute tags.

- ``zeroc::linear_cross_entropy`` against ``F.cross_entropy(F.linear(...))`` in eager:
  losses and gradients, bias, ignored rows, both reductions, chunk sizes, bf16, no-grad.
- ``fuse_linear_cross_entropy`` on compiled models: the plan text shows the op and no
  log-softmax, the pass counts what it rewrote or why it skipped, and training matches eager.
- ``tag_activation_recompute``: the number of tagged ops and the bytes the forward saves,
  counted from the compiled graphs, with the numbers unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models.gpt import GPT, GPTConfig
from models.llama import Llama
from parity import ADAM, assert_tensors_match
from torch import nn
from torch.testing import FileCheck

import zeroc
from zeroc.passes import linear_cross_entropy as fused_pass
from zeroc.passes.linear_cross_entropy import autocast_dtype
from zeroc.runtime.kernels.linear_cross_entropy import default_chunk_rows, linear_cross_entropy

ROWS, WIDTH, VOCAB = 37, 16, 50


def _inputs(bias: bool, dtype: torch.dtype = torch.float32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(ROWS, WIDTH, generator=generator).to(dtype).requires_grad_()
    w = torch.randn(VOCAB, WIDTH, generator=generator).to(dtype).requires_grad_()
    b = torch.randn(VOCAB, generator=generator).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    targets[[3, 10]] = -100
    return h, w, b, targets


def _grads(loss: torch.Tensor, tensors: list[torch.Tensor | None]) -> list[torch.Tensor]:
    present = [t for t in tensors if t is not None]
    return list(torch.autograd.grad(loss, present))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_rows", [None, 1, 8, 1000])
def test_op_matches_eager(bias: bool, reduction: str, chunk_rows: int) -> None:
    h, w, b, targets = _inputs(bias)
    expected = F.cross_entropy(F.linear(h, w, b), targets, reduction=reduction)
    actual = linear_cross_entropy(h, w, b, targets, reduction=reduction, chunk_rows=chunk_rows)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-5)
    # The backward scales the precomputed gradients by what autograd sends back.
    for got, want in zip(_grads(0.7 * actual, [h, w, b]), _grads(0.7 * expected, [h, w, b]),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_op_bf16_within_bf16_tolerance() -> None:
    h, w, _, targets = _inputs(False, torch.bfloat16)
    expected = F.cross_entropy(F.linear(h.float(), w.float()), targets)
    actual = linear_cross_entropy(h, w, None, targets, chunk_rows=8)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected, rtol=1.6e-2, atol=1e-2)
    got = _grads(actual, [h, w])
    want = _grads(expected, [h, w])
    for g, e in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), e.float(), rtol=1.6e-2, atol=1e-2)


def test_op_without_grad_and_all_rows_ignored() -> None:
    h, w, _, targets = _inputs(False)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, None, targets)
        assert loss.grad_fn is None
        torch.testing.assert_close(loss, F.cross_entropy(h @ w.t(), targets))
    ignored = torch.full_like(targets, -100)
    # As F.cross_entropy: a mean over no counted rows is NaN.
    assert torch.isnan(linear_cross_entropy(h, w, None, ignored))
    assert torch.isnan(F.cross_entropy(h @ w.t(), ignored))


def test_op_rejects_bad_arguments() -> None:
    h, w, _, targets = _inputs(False)
    with pytest.raises(ValueError, match="reduction='none'.*allowed are \\['mean', 'sum'\\]"):
        linear_cross_entropy(h, w, None, targets, reduction="none")
    with pytest.raises(ValueError, match="chunk_rows=-1"):
        linear_cross_entropy(h, w, None, targets, chunk_rows=-1)
    # ceil(vocab / width) chunks: each chunk of logits about as large as the input rows.
    assert default_chunk_rows(1024, 256, 4096) == 64
    assert default_chunk_rows(8192, 4096, 128_256) == 256
    assert default_chunk_rows(5, 64, 10) == 5


# The pass on, whatever the head's size (the default, "auto", fuses only large logits off CUDA).
FUSED = {"fused_loss": True}


def _train(model: nn.Module, batch: tuple[torch.Tensor, ...], compiled: bool,
           options: dict | None = None, steps: int = 2) -> tuple[list[float], nn.Module]:
    run = torch.compile(model, backend="zeroc", options=options or {}) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    losses = []
    for _ in range(steps):
        loss = run(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, run


def _pass_stats(plan: zeroc.Plan, name: str) -> dict[str, str]:
    records = [p for p in plan.passes if p.pass_name == name]
    assert records, f"no record of pass {name}"
    return dict(records[0].stats)


@pytest.mark.parametrize("model_cls", [GPT, Llama])
def test_compiled_head_is_fused_and_trains_like_eager(model_cls: type) -> None:
    eager, model = model_cls(seed=0), model_cls(seed=0)
    batch = eager.example_batch(batch_size=4, seed=1)
    expected, _ = _train(eager, batch, compiled=False)
    losses, run = _train(model, batch, compiled=True, options=FUSED)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5,
                               atol=1e-6)
    assert_tensors_match(dict(eager.named_parameters()), dict(model.named_parameters()),
                         "parameters")
    plan = zeroc.explain(run)
    assert _pass_stats(plan, "fuse_linear_cross_entropy") == {"rewritten": "1"}
    forward = plan.graph("g0.forward").code
    backward = plan.graph("g0.backward").code
    FileCheck().check("zeroc.linear_cross_entropy.default(").check_not("log_softmax") \
        .check_not("nll_loss").run(forward)
    FileCheck().check_not("nll_loss_backward").check_not("log_softmax_backward").run(backward)


def test_fused_loss_off_keeps_logits_and_saves_more() -> None:
    config = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, d_model=32)
    saved = {}
    for fused in (True, False):
        torch._dynamo.reset()
        model = GPT(config, seed=0)
        batch = model.example_batch(batch_size=4, seed=1)
        _, run = _train(model, batch, compiled=True, options={"fused_loss": fused}, steps=1)
        plan = zeroc.explain(run)
        saved[fused] = plan.memory[0].activations
        forward = plan.graph("g0.forward").code
        if fused:
            FileCheck().check("zeroc.linear_cross_entropy").run(forward)
        else:
            assert _pass_stats(plan, "fuse_linear_cross_entropy") == {"disabled": "True"}
            FileCheck().check("nll_loss_forward").run(forward)
    # Unfused, the forward saves the (rows x vocab) log-softmax and the backward makes more
    # tensors of that size; fused, it saves the gradients of the head's input (rows x width)
    # and weight (vocab x width) instead.
    rows, width, vocab = 4 * config.block_size, config.d_model, config.vocab_size
    assert saved[False] - saved[True] >= 4 * (rows * vocab - rows * width - vocab * width)


def test_auto_fuses_on_cuda_and_large_logits_only(monkeypatch) -> None:
    """fused_loss="auto": small CPU logits stay unfused (the stats say why), logits past the
    fraction of the device's memory are fused, and CUDA logits always are."""
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=32),
                seed=0)
    batch = model.example_batch(batch_size=2, seed=1)
    _, run = _train(model, batch, compiled=True, steps=1)
    stats = _pass_stats(zeroc.explain(run), "fuse_linear_cross_entropy")
    assert stats["rewritten"] == "0"
    assert "fused_loss='auto': logits of 8.0 KiB are under 1/2048 of the cpu memory" \
        in stats["skipped"]
    torch._dynamo.reset()
    monkeypatch.setattr(fused_pass, "LARGE_LOGITS_FRACTION", 1e-12)
    _, run = _train(GPT(model.config, seed=0), batch, compiled=True, steps=1)
    assert _pass_stats(zeroc.explain(run), "fuse_linear_cross_entropy") == {"rewritten": "1"}
    logits = torch.empty(32, 64, device="meta")
    assert fused_pass._small_logits("auto", torch.device("cuda"), logits) is None
    assert fused_pass._small_logits(True, torch.device("cpu"), logits) is None


class _HeadModel(nn.Module):
    """A head whose loss call is configurable, to exercise the pass's matches and refusals."""

    def __init__(self, loss_kwargs: dict, return_logits: bool = False) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 12)
        self.loss_kwargs = loss_kwargs
        self.return_logits = return_logits

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        logits = self.head(torch.tanh(self.body(x)))
        loss = F.cross_entropy(logits.view(-1, 12), y.view(-1), **self.loss_kwargs)
        return (loss, logits) if self.return_logits else loss


@pytest.mark.parametrize("loss_kwargs, return_logits, expected", [
    ({}, False, {"rewritten": "1"}),
    ({"reduction": "sum", "ignore_index": 3}, False, {"rewritten": "1"}),
    ({"label_smoothing": 0.1}, False, {"rewritten": "0", "skipped": "label smoothing: 1"}),
    ({"reduction": "none"}, False,
     {"rewritten": "0", "skipped": "reduction not mean/sum: 1"}),
    ({}, True, {"rewritten": "0", "skipped": "logits used by more than the loss: 1"}),
])
def test_pass_rewrites_only_exact_matches(loss_kwargs, return_logits, expected) -> None:
    torch.manual_seed(0)
    eager = _HeadModel(loss_kwargs, return_logits)
    model = _HeadModel(loss_kwargs, return_logits)
    model.load_state_dict(eager.state_dict())
    x, y = torch.randn(3, 5, 8), torch.randint(0, 12, (3, 5))
    run = torch.compile(model, backend="zeroc", options=FUSED)
    got, want = run(x, y), eager(x, y)
    got_loss = (got[0] if return_logits else got).sum()
    want_loss = (want[0] if return_logits else want).sum()
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    got_loss.backward()
    want_loss.backward()
    assert_tensors_match({n: p.grad for n, p in eager.named_parameters()},
                         {n: p.grad for n, p in model.named_parameters()}, "gradients")
    assert _pass_stats(zeroc.explain(run), "fuse_linear_cross_entropy") == expected


class _AutocastHead(_HeadModel):
    """The loss computed inside an autocast region of the model itself."""

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(x, y)


@pytest.mark.parametrize("region", ["around the call", "inside the model"])
def test_autocast_casts_the_head_inputs_as_eager_autocast(region: str) -> None:
    torch.manual_seed(0)
    cls = _AutocastHead if region == "inside the model" else _HeadModel
    eager, model = cls({}), cls({})
    model.load_state_dict(eager.state_dict())
    x, y = torch.randn(3, 5, 8), torch.randint(0, 12, (3, 5))
    run = torch.compile(model, backend="zeroc", options=FUSED)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = run(x, y), eager(x, y)
    # Eager autocast runs cross_entropy in float32, on logits of a bf16 matmul.
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    got.backward()
    want.backward()
    for (name, p_eager), p_model in zip(eager.named_parameters(), model.parameters(),
                                        strict=True):
        assert p_model.grad.dtype == torch.float32
        torch.testing.assert_close(p_model.grad, p_eager.grad, rtol=1.6e-2, atol=1e-2,
                                   msg=name)
    plan = zeroc.explain(run)
    assert _pass_stats(plan, "fuse_linear_cross_entropy") == {"rewritten": "1",
                                                              "autocast": "1"}
    FileCheck().check("torch.bfloat16").check("zeroc.linear_cross_entropy.default(") \
        .run(plan.graph("g0.forward").code)


def test_autocast_of_another_device_or_disabled_casts_nothing() -> None:
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    cpu = torch.device("cpu")
    assert autocast_dtype(node, {node: ("cpu", torch.bfloat16, True)}, cpu) == torch.bfloat16
    assert autocast_dtype(node, {node: ("cuda", torch.bfloat16, True)}, cpu) is None
    assert autocast_dtype(node, {node: ("cpu", torch.bfloat16, False)}, cpu) is None
    assert autocast_dtype(node, {}, cpu) is None
    with torch.autocast("cpu", dtype=torch.float16):
        assert autocast_dtype(node, {}, cpu) == torch.float16


def test_no_grad_computes_no_gradients() -> None:
    model = _HeadModel({})
    x, y = torch.randn(3, 5, 8), torch.randint(0, 12, (3, 5))
    run = torch.compile(model, backend="zeroc", options=FUSED)
    with torch.no_grad():
        loss = run(x, y)
    torch.testing.assert_close(loss, model(x, y), rtol=1e-6, atol=1e-6)
    inference = zeroc.explain(run).graph("g0.inference").code
    # need_grad (the op's last argument) is False: no gradient is computed in inference.
    FileCheck().check("zeroc.linear_cross_entropy.default(").check_same("False)").run(inference)


def test_auto_recompute_tags_decomposed_chains_on_the_inductor_path() -> None:
    """On CUDA Inductor compiles the graphs, so the joint graph is traced with its
    decompositions (no ``aten.gelu``); planned on fake CUDA tensors, ``"auto"`` still tags
    the GELU chains and the forward saves less than with recompute off."""
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32)
    x, y = GPT(config, seed=0).example_batch(batch_size=8, seed=1)
    saved, tagged = {}, {}
    for setting in ("auto", False):
        plan = zeroc.explain(GPT(config, seed=0), (x, y), world=2, zero=3, device="cuda",
                             options={"activation_recompute": setting})
        saved[setting] = plan.stages[0].activation_bytes
        tagged[setting] = _pass_stats(plan, "tag_activation_recompute")
    assert int(tagged["auto"]["tagged"]) >= config.n_layer  # one GELU chain per block
    assert tagged[False] == {"disabled": "activation_recompute=False"}
    rows, hidden = 8 * config.block_size, 4 * config.d_model
    assert saved[False] - saved["auto"] >= config.n_layer * rows * hidden * 4


def test_cheap_ops_are_recomputed_not_saved() -> None:
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, d_model=32)
    saved, tagged = {}, {}
    for partitioner in ("min_cut", "default"):
        torch._dynamo.reset()
        eager, model = GPT(config, seed=0), GPT(config, seed=0)
        batch = eager.example_batch(batch_size=4, seed=1)
        expected, _ = _train(eager, batch, compiled=False)
        losses, run = _train(model, batch, compiled=True,
                             options={"partitioner": partitioner, "fused_loss": False,
                                      "activation_recompute": True})
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5,
                                   atol=1e-6)
        plan = zeroc.explain(run)
        saved[partitioner] = plan.memory[0].activations
        tagged[partitioner] = _pass_stats(plan, "tag_activation_recompute")
    # Per block: GELU and both layer norms; the final norm too (the head's weight gradient
    # reads its output). Each saves one (batch, seq, width) tensor, the GELU output 4x that.
    rows = 4 * config.block_size
    per_block = 4 * (rows * 4 * config.d_model + 2 * rows * config.d_model)
    n_tagged = 3 * config.n_layer + 1
    assert tagged["min_cut"] == {"tagged": str(n_tagged),
                                 "bytes_not_saved": str(config.n_layer * per_block
                                                        + 4 * rows * config.d_model)}
    assert tagged["default"] == {"disabled": "partitioner is not min_cut"}
    assert saved["min_cut"] < saved["default"]
