"""Evaluation as users write it, between training steps, equal to eager.

A training loop evaluates with ``model.eval()`` under ``torch.no_grad()`` or
``torch.inference_mode()``, at batch sizes of its own, and each rank often evaluates its own
part of the data set, so the ranks' batches differ in size (an uneven last batch). Dynamo then
traces one rank's batch size as a symbol and another's as a constant (sizes 0 and 1 are
never symbolic): the ranks compile graphs that differ in activation shapes only. Their
collectives are the same, and zeroc's cross-rank check compares exactly those
(``zeroc.runtime.consistency.collective_text``), so evaluation runs; its losses equal eager's
on the same rows, and training after it goes on equal to eager. The Llama has one decoder
layer: the ranks' graphs differ in their batch dimension whatever the model's depth, and
Dynamo's trace of every graph (training's and each evaluation's) grows with the layers.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from models import hf

import zeroc

WORLD = 2
ADAM = {"lr": 1e-2}
# Evaluation batches (whole-batch size, sequence length), split unevenly over the ranks.
EVALUATIONS = ((3, 8), (5, 12), (2, 8))


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return hf.UserWrapper(hf.build("llama", layers=1))


def _train_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return hf.token_batch(batch=4, seq=8, seed=step)


def _rows(batch: tuple[torch.Tensor, ...], rank: int) -> tuple[torch.Tensor, ...]:
    """This rank's rows: ``tensor_split`` gives the first ranks one more row, or none."""
    return tuple(t.tensor_split(WORLD)[rank] for t in batch)


def _evaluate(run, rank: int, step: int) -> list[float]:
    losses = []
    for index, (batch, seq) in enumerate(EVALUATIONS):
        rows = _rows(hf.token_batch(batch=batch, seq=seq, seed=100 + step * 10 + index), rank)
        context = torch.inference_mode() if index % 2 else torch.no_grad()
        with context:
            losses.append(run(*rows).item())
    return losses


def evaluation_job(rank: int, world: int, zero: int) -> dict:
    model = zeroc.parallelize(_model(), zero=zero)
    compiled = torch.compile(model, backend="zeroc")
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    train, evaluation = [], []
    for step in range(2):
        model.train()
        loss = compiled(*_rows(_train_batch(step), rank))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        train.append(loss.item())
        model.eval()
        evaluation.append(_evaluate(compiled, rank, step))
    return {"train": train, "evaluation": evaluation}


def _eager(rank: int) -> dict:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    train, evaluation = [], []
    for step in range(2):
        model.train()
        batch = _train_batch(step)
        losses = [model(*_rows(batch, r)) for r in range(WORLD)]
        (sum(losses) / WORLD).backward()  # zeroc averages the ranks' gradients
        optimizer.step()
        optimizer.zero_grad()
        train.append(losses[rank].item())
        model.eval()
        evaluation.append(_evaluate(model, rank, step))
    return {"train": train, "evaluation": evaluation}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("zero", [3])
def test_evaluation_at_uneven_batch_sizes_equals_eager(zero: int) -> None:
    ranks = run_ranks(evaluation_job, WORLD, zero, timeout=500)
    for rank, result in enumerate(ranks):
        expected = _eager(rank)
        torch.testing.assert_close(torch.tensor(result["train"]),
                                   torch.tensor(expected["train"]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(sum(result["evaluation"], [])),
                                   torch.tensor(sum(expected["evaluation"], [])),
                                   rtol=1e-5, atol=1e-6)
