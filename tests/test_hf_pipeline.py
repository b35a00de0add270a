"""Hugging Face models pipelined: seven architectures' gradients at pp=2 (1F1B, in a user's
module) and GPT2 trained at pp=4 (1F1B, called with ``labels=``, 30% of the training labels
``-100``, so the model's own token-mean loss must be exact over micro-batches, and its tied
embedding and head sit on the first and last of four stages).

Each model is built from a small config (``tests/models/hf.py``) on every rank under the
same seed, parallelized with ``pp`` pipeline ranks and compiled; the pipelined loss and every
gradient (each rank holds its stages' gradients) must equal single-process eager on the same
batch, and two AdamW steps of the training case must give eager's losses, first gradients and
parameters. Nothing in the models is changed for the pipeline: the blocks are found at
``transformer.h.N`` / ``model.layers.N``, the micro-batch graphs are traced at the micro-batch
size, and transformers' logging inside the forward does not split the graph.

Covered elsewhere, so not run here: T5 at pp=2 (DualPipeV, every block a stage) and BART at
pp=2 and pp=4 in ``tests/test_encoder_decoder_pipeline.py``, which runs DualPipeV with a
user's wrapper too; Llama trained in pipelines with its own ``labels=`` loss (pp=2 x dp=2
with DualPipeV and 1F1B, ignored labels) in ``tests/test_pipeline_dp_loss.py`` (its one
test), and returning ``.loss`` and ``.logits`` from a pipeline (DualPipeV, DualPipe) in
``tests/test_pipeline_evaluation.py``; a model called directly with ``labels=`` under 1F1B
at pp=2 (the MoE decoders) in ``tests/test_hf_moe.py::test_two_ranks_equal_eager``; 1F1B at
pp=4 on the zoo GPT in ``tests/test_stage_memory.py``; DualPipeV at pp=4 in
``tests/test_pipeline_parity.py::test_pp4_every_schedule``.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from parity import assert_gradients_match, gradients, merge_held

transformers = pytest.importorskip("transformers")

from models.hf import ARCHITECTURES, UserWrapper, build, token_batch  # noqa: E402

import zeroc  # noqa: E402

STEPS = 2
TRAIN_BATCH = 16  # 4 micro-batches of 4
# Labels ignored at random in training: the micro-batches count different numbers of tokens.
IGNORED = 0.3


# Blocks of the gradient cases: one per stage of two (Dynamo's trace grows with the blocks).
GRADIENT_LAYERS = 2


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
        model, compiled = _pipelined(name, GRADIENT_LAYERS, False, world, "1f1b")
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
    model = _model(name, GRADIENT_LAYERS, False)
    loss = _loss(model, False, *token_batch())
    loss.backward()
    return loss.item(), gradients(model)


def _eager_training(name: str, direct: bool, pp: int,
                    schedule: str) -> tuple[list[float], dict, dict]:
    model = _model(name, _training_layers(pp, schedule), direct)
    losses, grads = _train(model, model, direct)
    return losses, grads, dict(model.named_parameters())


# GPT2's gradients are checked by its training case (pp=4); Llama's and T5's pipelines run in
# the files the module docstring names.
GRADIENT_ARCHITECTURES = tuple(name for name in ARCHITECTURES
                               if name not in ("gpt2", "llama", "t5"))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_seven_architectures_pipeline_at_pp2_equal_eager() -> None:
    ranks = run_ranks(gradients_job, 2, GRADIENT_ARCHITECTURES, timeout=1100)
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


# (model, called directly with labels=, schedule). pp=4 runs 4 ranks on the suite's two
# cores (its slowest cases): one case.
CASES_PP4 = (("gpt2", True, "1f1b"),)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_gpt2_trains_at_pp4_equal_eager() -> None:
    _check_training(run_ranks(training_job, 4, CASES_PP4, timeout=1100), CASES_PP4)
