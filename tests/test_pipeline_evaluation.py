"""A pipeline's evaluation returns the model's real outputs and compiles forward graphs only.

A user evaluates a pipelined Hugging Face model as any other: ``model.eval()``, then under
``torch.no_grad()`` or ``torch.inference_mode()`` a call with labels (loss and logits) or
without (logits alone), at a batch size training never used. Dynamo traces that call as a
graph of its own (it guards on the grad mode), which zeroc compiles as an evaluation graph:
forward-only stage graphs (no joint graph is exported) whose last stage returns the logits,
made whole on every rank of the pipeline; a last batch that the micro-batch count does not
divide runs as the nearest count that divides it. Here, after a training step, DualPipeV
(whose last stage sits on one position, as in 1F1B, GPipe and ZB1P) at ZeRO 0 and DualPipe
(whose last stages sit on both positions) at ZeRO 3 return eager's loss and logits on every
rank, evaluating 6 rows: a batch size training never used, which the 4 micro-batches do not
divide. The Llama has one decoder layer per stage: four for DualPipeV's four stages at pp=2,
two for DualPipe's two (Dynamo's trace grows with the layers).

Each evaluation graph is a compile of its own on every rank, so each runs once: the call
without labels (under ``torch.inference_mode()``) on DualPipeV alone (which positions hold the
last stage is the schedule's business, whether the outputs hold a loss is not), and a batch
the micro-batches divide is not evaluated apart (it runs the same forward-only schedule with
the count asked for; ``tests/test_pipeline_losses.py`` evaluates a pipeline at its training
batch).
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from models import hf
from torch import nn

import zeroc
from zeroc.pipeline import pipeline_capture, stage_trace

WORLD = 2
# (schedule, micro-batches, zero, decoder layers, also called without labels): the last stage
# on one position (DualPipeV, as 1F1B, GPipe and ZB1P have it) and on both (DualPipe)
CASES = (("dualpipev", 4, 0, 4, True), ("dualpipe", 4, 3, 2, False))
# (batch, sequence length): evaluation at a batch size training never used, 6 rows, which the
# 4 micro-batches do not divide (a last batch)
TRAIN, EVAL = (8, 8), (6, 12)


class Outputs(nn.Module):
    """A user's module that returns the Hugging Face output (``.loss``, ``.logits``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False)


def _model(layers: int) -> nn.Module:
    torch.manual_seed(1)
    return Outputs(hf.build("llama", layers=layers))


def _steps(run, model: nn.Module, optimizer: torch.optim.Optimizer, plain: bool,
           trained=lambda: None) -> dict:
    model.train()
    out = run(*hf.token_batch(*TRAIN, seed=0))
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    trained()
    model.eval()
    ids, labels = hf.token_batch(*EVAL, seed=1)
    with torch.no_grad():
        scored = run(ids, labels)
    out = {"train": out.loss.item(), "loss": scored.loss.item(), "logits": scored.logits.clone()}
    if plain:  # without labels: the logits alone
        with torch.inference_mode():
            out["plain"] = run(ids).logits.clone()
    return out


def evaluation_job(rank: int, world: int) -> dict:
    joints = []
    export = pipeline_capture.export_stage

    def counted(*args, **kwargs):
        joints.append(kwargs.get("trace_joint"))
        return export(*args, **kwargs)

    # The joint graphs are exported in pipeline_capture, the forward-only ones in stage_trace.
    pipeline_capture.export_stage = stage_trace.export_stage = counted
    trained: list[int] = []  # the exports when each case's training step ends
    out = {}
    for schedule, microbatches, zero, layers, plain in CASES:
        torch._dynamo.reset()
        model = zeroc.parallelize(_model(layers), zero=zero, pp=world)
        compiled = torch.compile(model, backend="zeroc",
                                 options={"schedule": schedule, "microbatches": microbatches})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        joints.clear()
        result = _steps(compiled, model, optimizer, plain, lambda: trained.append(len(joints)))
        result["training_exports"] = joints[:trained[-1]]
        result["evaluation_exports"] = joints[trained[-1]:]
        # The plan stays the training step's: the evaluation's Program is not the one shown.
        result["plan_graphs"] = [g.name for g in zeroc.explain(compiled).graphs]
        out[schedule] = result
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pipeline_evaluation_returns_eager_outputs_on_every_rank() -> None:
    ranks = run_ranks(evaluation_job, WORLD, timeout=850)
    for schedule, _, _, layers, plain in CASES:
        model = _model(layers)
        expected = _steps(model, model, torch.optim.SGD(model.parameters(), lr=0.1), plain)
        for rank, result in enumerate(ranks):
            got = result[schedule]
            where = f"rank {rank}, {schedule}"
            # Training exports joint graphs; the evaluation (with labels, and on DualPipeV
            # without) exports forward-only graphs alone.
            assert True in got["training_exports"], (where, got["training_exports"])
            assert got["evaluation_exports"] and True not in got["evaluation_exports"], (
                where, got["evaluation_exports"])
            assert any(name.endswith(".backward") for name in got["plan_graphs"]), (
                where, got["plan_graphs"])
            assert set(got) - set(expected) == {
                "training_exports", "evaluation_exports", "plan_graphs"}, (where, set(got))
            for key in ("train", "loss"):
                torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(expected[key]),
                                           rtol=1e-5, atol=1e-6, msg=f"{where}: {key}")
            for key in ("logits", "plain")[:1 + plain]:
                assert got[key].device.type == "cpu", (where, key, got[key].device)
                torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-5,
                                           msg=f"{where}: {key}")
