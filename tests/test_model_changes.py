"""Changes to a model after ``zeroc.parallelize``: honoured at the next step, or refused by name.

On 2 gloo ranks at every ZeRO stage, a model is parallelized and compiled, then trained two
steps after each change of ``requires_grad`` (parameters frozen after ``parallelize``, one
frozen before it and unfrozen after, everything unfrozen again); after every phase each
parameter must equal single-process eager on the global batch, the ranks must hold the same
values, a frozen parameter must not have moved and the same parameters must have a
gradient as in eager. A module added afterwards that the forward reaches must raise on
every rank, naming its parameters. The pipeline case (pp=2) freezes parameters of both
stages and the embedding tied across them. Single-process cases: assigning, deleting or
registering again a parallelized parameter raises, naming it; a ``requires_grad`` change
the pre-hook cannot see (the model called from a compiled function) is honoured for a
freeze and refused for an unfreeze; an eager parallelized model follows every change.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from models.gpt import GPT, GPTConfig
from models.mlp import MLP, MLPConfig
from parity import ADAM, assert_tensors_match
from torch import nn

import zeroc
from zeroc.frontend.model_changes import ModelChangedError

GLOBAL_BATCH, STEPS_PER_PHASE = 8, 2
# Frozen before parallelize (and in eager from the start); unfrozen in phase 2.
FROZEN_AT_START = ("layers.1.weight",)
# The parameters frozen in each phase; every phase trains STEPS_PER_PHASE steps.
PHASES = (
    FROZEN_AT_START,
    ("layers.0.weight", "head.bias", *FROZEN_AT_START),  # frozen after parallelize
    ("head.bias", "layers.1.bias"),  # layers.0.weight and layers.1.weight unfrozen
    (),
)


class Growing(MLP):
    """The zoo MLP with an optional module (``extra``, None at first) before its head."""

    def __init__(self) -> None:
        super().__init__(MLPConfig(), seed=1)
        self.extra: nn.Module | None = None

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        if self.extra is not None:
            x = self.extra(x)
        return F.mse_loss(self.head(x), targets)


def make_model() -> Growing:
    model = Growing()
    for name, param in model.named_parameters():
        param.requires_grad_(name not in FROZEN_AT_START)
    return model


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    cfg = MLPConfig()
    generator = torch.Generator().manual_seed(4)
    return [(torch.randn(GLOBAL_BATCH, cfg.in_features, generator=generator),
             torch.randn(GLOBAL_BATCH, cfg.out_features, generator=generator))
            for _ in range(len(PHASES) * STEPS_PER_PHASE)]


def _full(value: torch.Tensor | None) -> torch.Tensor | None:
    if value is None:
        return None
    return value.full_tensor() if hasattr(value, "full_tensor") else value.detach().clone()


def train_phases(model: nn.Module, call, rank: int = 0, world: int = 1) -> list[dict]:
    """Train through ``PHASES``; after each: every parameter in full and which have a
    gradient (read after the phase's last backward)."""
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    params = dict(model.named_parameters())
    per = GLOBAL_BATCH // world
    data = iter(batches())
    out = []
    for frozen in PHASES:
        for name, param in params.items():
            param.requires_grad_(name not in frozen)
        for _ in range(STEPS_PER_PHASE):
            x, y = next(data)
            call(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
            with_grad = sorted(n for n, p in params.items() if p.grad is not None)
            optimizer.step()
            optimizer.zero_grad()
        out.append({"params": {n: _full(p) for n, p in params.items()}, "grads": with_grad})
    return out


def freeze_job(rank: int, world: int, zero: int) -> dict:
    torch._dynamo.reset()
    model = zeroc.parallelize(make_model(), zero=zero)
    phases = train_phases(model, torch.compile(model, backend="zeroc"), rank, world)
    model.extra = nn.Linear(MLPConfig().hidden, MLPConfig().hidden)  # after parallelize
    x, y = batches()[0]
    try:
        torch.compile(model, backend="zeroc")(x, y)
        added = "no error"
    except ModelChangedError as error:
        added = str(error)
    return {"phases": phases, "added": added}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_requires_grad_changes_train_as_eager_and_added_modules_raise(zero: int) -> None:
    results = run_ranks(freeze_job, 2, zero, timeout=240)
    reference = make_model()
    eager = train_phases(reference, reference)
    start = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    for index, frozen in enumerate(PHASES):
        expected = eager[index]
        mine, other = (r["phases"][index] for r in results)
        what = f"zero={zero} phase {index} (frozen: {', '.join(frozen) or 'none'})"
        assert mine["grads"] == expected["grads"] == other["grads"], what
        assert_tensors_match(expected["params"], mine["params"], what)
        for name, value in mine["params"].items():  # replica against replica
            assert torch.equal(value, other["params"][name]), f"{what}: {name} differs"
        previous = results[0]["phases"][index - 1]["params"] if index else start
        for name in frozen:  # a frozen parameter has not moved
            assert torch.equal(mine["params"][name], previous[name]), f"{what}: {name} moved"
    for result in results:
        assert "'extra.weight', 'extra.bias'" in result["added"], result["added"]
        assert "zeroc.parallelize again" in result["added"], result["added"]


def make_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32))


# Stage 0's attention, stage 1's final norm, then stage 1's MLP and the embedding tied to the
# head (held by both stages), then nothing.
PIPELINE_PHASES = ((), ("layers.0.attn.qkv.weight", "ln_f.weight"),
                   ("layers.1.mlp.fc.weight", "tok_emb.weight"), ())


def train_pipeline(model: nn.Module, call, x: torch.Tensor, y: torch.Tensor, state) -> list:
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    params = dict(model.named_parameters())
    out = []
    for frozen in PIPELINE_PHASES:
        for name, param in params.items():
            param.requires_grad_(name not in frozen)
        for _ in range(STEPS_PER_PHASE):
            call(x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
        out.append(state())
    return out


def pipeline_job(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    torch._dynamo.reset()
    model = zeroc.parallelize(make_gpt(), zero=3, pp=2)
    compiled = torch.compile(model, backend="zeroc", options={"schedule": "1f1b"})
    x, y = make_gpt().example_batch(GLOBAL_BATCH)
    return train_pipeline(model, compiled, x, y, lambda: zeroc.full_state_dict(model))


@pytest.mark.timeout(300)
def test_requires_grad_changes_in_a_pipeline_train_as_eager() -> None:
    results = run_ranks(pipeline_job, 2, timeout=240)
    reference = make_gpt()
    x, y = reference.example_batch(GLOBAL_BATCH)
    eager = train_pipeline(reference, reference, x, y, lambda: {
        k: v.detach().clone() for k, v in reference.state_dict().items()})
    for index, frozen in enumerate(PIPELINE_PHASES):
        what = f"pp=2 phase {index} (frozen: {', '.join(frozen) or 'none'})"
        assert_tensors_match(eager[index], results[0][index], what)
        for name in frozen:
            assert torch.equal(results[0][index][name], results[0][index - 1][name]), (
                f"{what}: {name} moved")


def test_replacing_or_removing_a_parallelized_parameter_raises_naming_it() -> None:
    model = zeroc.parallelize(make_model(), zero=3)
    with pytest.raises(ModelChangedError, match=r"cannot assign parameter 'head\.weight'"):
        model.head.weight = nn.Parameter(torch.zeros(8, 32))
    with pytest.raises(ModelChangedError, match=r"cannot delete parameter 'layers\.0\.bias'"):
        del model.layers[0].bias
    with pytest.raises(ModelChangedError, match=r"re-register parameter 'head\.bias'"):
        model.head.register_parameter("bias", nn.Parameter(torch.zeros(8)))
    model.head.weight = model.head.weight  # the same parameter: nothing changes
    model.head.scale = nn.Parameter(torch.ones(8))  # a new name is the compile's to refuse
    x, y = batches()[0]
    assert torch.isfinite(torch.compile(model, backend="zeroc")(x, y))


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_changes_unseen_before_the_guards_are_honoured_or_refused() -> None:
    """From a compiled function the pre-hook is traced, not run: a freeze is still honoured
    (no gradient), an unfreeze raises once, naming the parameter, and the next call trains
    it. An eager parallelized model follows every change."""
    model = zeroc.parallelize(make_model(), zero=3)
    reference = make_model()
    compiled = torch.compile(lambda x, y: model(x, y), backend="zeroc")
    x, y = batches()[0]

    def step(call, net: nn.Module) -> dict[str, torch.Tensor | None]:
        net.zero_grad()
        call(x, y).backward()
        return _grads(net)

    for change in ("layers.0.weight", None, "layers.1.weight"):
        if change == "layers.0.weight":
            for net in (model, reference):
                net.layers[0].weight.requires_grad_(False)
        if change == "layers.1.weight":
            for net in (model, reference):
                net.layers[1].weight.requires_grad_(True)
            with pytest.raises(ModelChangedError, match=r"'layers\.1\.weight' was set after"):
                step(compiled, model)
        got, expected = step(compiled, model), step(reference, reference)
        assert {n for n, g in got.items() if g is None} == {
            n for n, g in expected.items() if g is None}, change
        for name, grad in expected.items():
            if grad is not None:
                torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6)
    eager_model = zeroc.parallelize(make_model(), zero=3)
    eager_model.head.bias.requires_grad_(False)
    eager_model.layers[1].weight.requires_grad_(True)
    grads = step(eager_model, eager_model)
    assert grads["head.bias"] is None and grads["layers.1.weight"] is not None
