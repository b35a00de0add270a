"""Encoder-decoder pipelines: encoder and decoder blocks are all cut points.

BART's ``model.encoder.layers`` and ``model.decoder.layers`` (T5's ``encoder.block`` and
``decoder.block``) are both containers of blocks (``zeroc.passes.front.stage_units``), so a model of
two encoder and two decoder layers has four cut points: DualPipeV's four stages at pp=2 hold
one block each, the encoder's output travelling through the decoder's stages, and a user may
pin a cut inside the encoder. Every schedule runs an encoder-decoder and equals eager on the
whole batch (the loss and every gradient, with the tied embedding summed over the stages that
hold it): T5 under DualPipeV and BART under GPipe (the cut pinned inside the encoder), ZB1P and
DualPipe at pp=2, BART under 1F1B at pp=4. Every model has two encoder and two decoder layers
(with one of each, zeroc finds a single layer and refuses two stages). BART under DualPipeV
at pp=2 is not run: T5 proves DualPipeV's four stages on an encoder-decoder and BART runs
the other schedules.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from models import hf
from parity import assert_tensors_match

import zeroc

# (model, schedule, micro-batches, split_points)
# Every schedule runs once (1F1B: BART at pp=4 below); T5 runs the one that needs all four
# cuts.
CASES_PP2 = (
    ("t5", "dualpipev", 4, None),
    ("bart", "gpipe", 2, ["model.model.encoder.layers.1"]),
    ("bart", "zb1p", 2, None),
    ("bart", "dualpipe", 4, None),
)
CASES_PP4 = (("bart", "1f1b", 4, None),)


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return hf.UserWrapper(hf.build(name, layers=4))


def pipeline_job(rank: int, world: int, cases: tuple) -> dict:
    out = {}
    for name, schedule, microbatches, split in cases:
        torch._dynamo.reset()
        model = zeroc.parallelize(_model(name), zero=0, pp=world)
        options = {"schedule": schedule, "microbatches": microbatches}
        if split is not None:
            options["split_points"] = split
        compiled = torch.compile(model, backend="zeroc", options=options)
        loss = compiled(*hf.token_batch(batch=8, seq=8, seed=0))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        stages = [s.modules for s in zeroc.explain(compiled).stages] if rank == 0 else None
        out[(name, schedule, split is not None)] = {"loss": loss.item(), "grads": grads,
                                                    "stages": stages}
    return out


def _check(ranks: list[dict], cases: tuple) -> None:
    for name, schedule, _, split in cases:
        key = (name, schedule, split is not None)
        model = _model(name)
        loss = model(*hf.token_batch(batch=8, seq=8, seed=0))
        loss.backward()
        expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        held: dict[str, torch.Tensor] = {}
        for result in ranks:
            torch.testing.assert_close(torch.tensor(result[key]["loss"]), loss.detach(),
                                       rtol=1e-5, atol=1e-6, msg=str(key))
            for param, grad in result[key]["grads"].items():
                if param in held:  # the same parameter on two ranks: the same gradient
                    torch.testing.assert_close(grad, held[param], msg=f"{key} {param}")
                held[param] = grad
        assert_tensors_match(expected, held, str(key))
        units = " ".join(u for stage in ranks[0][key]["stages"] for u in stage)
        assert "encoder" in units and "decoder" in units, units


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_schedule_runs_encoder_decoders_at_pp2_equal_eager() -> None:
    _check(run_ranks(pipeline_job, 2, CASES_PP2, timeout=850), CASES_PP2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bart_at_pp4_equals_eager() -> None:
    _check(run_ranks(pipeline_job, 4, CASES_PP4, timeout=550), CASES_PP4)
