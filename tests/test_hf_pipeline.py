"""Hugging Face models pipelined: ten architectures at pp=2, GPT2 and Llama trained at pp=2
with 1F1B and DualPipeV and Llama at pp=4 with 1F1B, wrapped in a user's module or called
with ``labels=`` (30% of the training labels ``-100``, so the model's own token-mean loss must
be exact): every pair of model and wrapping, model and schedule, wrapping and schedule runs
(``CASES_PP2``, ``CASES_PP4``; a wrapper only changes how the loss is read). DualPipeV at
pp=2 already runs stages between the first and the last (four stages on two ranks);
DualPipeV at pp=4 runs on the zoo's GPT in ``tests/test_pipeline_parity.py``, BART at pp=4 in
``tests/test_encoder_decoder_pipeline.py``.

Each model is built from a small config (``tests/models/hf.py``) on every rank under the
same seed, parallelized with ``pp`` pipeline ranks and compiled; the pipelined loss and every
gradient (each rank holds its stages' gradients) must equal single-process eager on the same
batch, and three AdamW steps must give eager's losses and parameters (and, in the training
cases, the first step's gradients eager's: GPT2's and Llama's gradient cases are their
wrapped 1F1B training cases at pp=2). Nothing in the models is changed for the pipeline: the
blocks are found at ``transformer.h.N`` / ``model.layers.N``, the micro-batch graphs are
traced at the micro-batch size, and transformers' logging inside the forward does not split
the graph. One ``run_ranks`` call per world size runs all of that world's cases (the 2-rank
one a module fixture shared by two tests).
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from parity import assert_gradients_match, gradients, merge_held

transformers = pytest.importorskip("transformers")

from models.hf import ARCHITECTURES, UserWrapper, build, token_batch  # noqa: E402

import zeroc  # noqa: E402

STEPS = 3
TRAIN_BATCH = 16  # 4 micro-batches of 4
# Labels ignored at random in training: the micro-batches count different numbers of tokens.
IGNORED = 0.3


def _gradient_layers(name: str) -> int:
    """Blocks of the ten architectures' gradient case: one per stage of two (Dynamo's trace
    grows with the blocks). T5 holds half its blocks in the encoder, whose blocks zeroc's
    stages cut: four blocks give it two."""
    return 4 if name == "t5" else 2


def _model(name: str, layers: int, direct: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build(name, layers)
    return model if direct else UserWrapper(model)


def _loss(model, direct: bool, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=labels).loss if direct else model(ids, labels)


def _pipelined(name: str, layers: int, direct: bool, pp: int, schedule: str):
    torch._dynamo.reset()
    model = zeroc.parallelize(_model(name, layers, direct), zero=0, pp=pp)
    # DualPipeV runs 2 * pp stages and needs at least as many micro-batches.
    microbatches = max(4, 2 * pp) if schedule == "dualpipev" else 4
    compiled = torch.compile(model, backend="zeroc",
                             options={"schedule": schedule, "microbatches": microbatches})
    return model, compiled


def gradients_job(rank: int, world: int, names: tuple[str, ...]) -> dict:
    """One forward and backward of each of ``names`` at pp=``world`` (1F1B): its loss and
    the gradients this rank holds."""
    out = {}
    for name in names:
        model, compiled = _pipelined(name, _gradient_layers(name), False, world, "1f1b")
        loss = _loss(compiled, False, *token_batch())
        loss.backward()
        out[name] = {"loss": loss.item(), "grads": gradients(model)}
    return out


def _train(model: torch.nn.Module, run, direct: bool) -> tuple[list[float], dict]:
    """``STEPS`` AdamW steps of ``model``, its forward called through ``run``; the losses and
    the gradients (those held) after the first backward."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = _loss(run, direct, *token_batch(TRAIN_BATCH, seed=step, ignored=IGNORED))
        loss.backward()
        if step == 0:
            grads = gradients(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads


def _training_layers(pp: int, schedule: str) -> int:
    """One block per stage: DualPipeV runs 2 * pp stages, 1F1B pp (Dynamo's trace grows
    with the blocks)."""
    return 2 * pp if schedule == "dualpipev" else pp


def training_job(rank: int, world: int, cases: tuple) -> dict:
    out = {}
    for name, direct, schedule in cases:
        model, compiled = _pipelined(name, _training_layers(world, schedule), direct, world,
                                     schedule)
        losses, grads = _train(model, compiled, direct)
        out[(name, direct, schedule)] = {
            "losses": losses, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return out


def _eager_gradients(name: str) -> tuple[float, dict]:
    model = _model(name, _gradient_layers(name), False)
    loss = _loss(model, False, *token_batch())
    loss.backward()
    return loss.item(), gradients(model)


def _eager_training(name: str, direct: bool, pp: int,
                    schedule: str) -> tuple[list[float], dict, dict]:
    model = _model(name, _training_layers(pp, schedule), direct)
    losses, grads = _train(model, model, direct)
    return losses, grads, dict(model.named_parameters())


# GPT2's and Llama's gradients are checked by their training cases (wrapped, 1F1B, pp=2).
GRADIENT_ARCHITECTURES = tuple(name for name in ARCHITECTURES if name not in ("gpt2", "llama"))


def two_rank_job(rank: int, world: int) -> dict:
    return {"gradients": gradients_job(rank, world, GRADIENT_ARCHITECTURES),
            "training": training_job(rank, world, CASES_PP2)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(two_rank_job, 2, timeout=1100)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ten_architectures_pipeline_at_pp2_equal_eager(two_ranks: list[dict]) -> None:
    ranks = [rank["gradients"] for rank in two_ranks]
    for name in GRADIENT_ARCHITECTURES:
        loss, grads = _eager_gradients(name)
        assert ranks[0][name]["loss"] == pytest.approx(loss, rel=1e-5), name
        assert ranks[1][name]["loss"] == ranks[0][name]["loss"], name
        held = merge_held([rank[name]["grads"] for rank in ranks])
        assert_gradients_match(grads, held, name, rtol=1e-4, atol=1e-5)


def _check_training(ranks: list[dict], cases: tuple) -> None:
    for case in cases:
        name, direct, schedule = case
        losses, grads, params = _eager_training(name, direct, len(ranks), schedule)
        for rank in ranks:
            assert rank[case]["losses"] == pytest.approx(losses, rel=1e-5), case
        held = merge_held([rank[case]["grads"] for rank in ranks])
        assert_gradients_match(grads, held, str(case), rtol=1e-4, atol=1e-5)
        # A rank trains its own stages; every stage is some rank's.
        for param_name, param in params.items():
            closest = min((held - param.detach()).abs().max().item() for rank in ranks
                          if (held := rank[case]["params"].get(param_name)) is not None
                          and held.numel())
            assert closest < 1e-5, (case, param_name, closest)


# (model, called directly with labels=, schedule). pp=4 (4 ranks on the suite's two cores:
# its slowest cases) runs one case. Between them every pair of model, wrapping and schedule
# runs; the wrapped 1F1B cases at pp=2 are GPT2's and Llama's gradient cases.
CASES_PP2 = (("gpt2", False, "1f1b"), ("gpt2", True, "dualpipev"), ("llama", False, "1f1b"),
             ("llama", False, "dualpipev"))
CASES_PP4 = (("llama", True, "1f1b"),)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_gpt2_and_llama_train_at_pp2_equal_eager(two_ranks: list[dict]) -> None:
    _check_training([rank["training"] for rank in two_ranks], CASES_PP2)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_llama_trains_at_pp4_equal_eager() -> None:
    _check_training(run_ranks(training_job, 4, CASES_PP4, timeout=1100), CASES_PP4)
