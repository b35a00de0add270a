"""The tuner's screen at scale: a screened peak within 10% of the planned peak.

``zeroc.tune(world=W)`` drops every layout whose screened peak exceeds the device before any
is planned, so a screen that counts too little plans layouts that cannot fit, and one that
counts too much rejects the winner. A long sequence is where the screen lost count: a
Llama's attention scores (``heads x seq x seq`` per row) outgrow its logits (``seq x
vocab``) once ``heads x seq > vocab`` (7B at 4096 tokens: 131072 > 32000), and the screen
took the largest output for the logits, so the fused loss "freed" the scores of every layer
(a 7B step of 8 x 4096 tokens at pp=8 screened at 24 GiB, planned at 101 GiB). These tests
screen and plan the same candidates of Llamas with such sequences, one narrow and quick, one
with a 7B layer's full width. The Llamas use Hugging Face's eager attention, which holds the
scores on a GPU too (SDPA on a planned GPU takes a fused kernel that holds none:
``tests/test_planned_attention.py``).
"""

from __future__ import annotations

import pytest
import torch

from zeroc.runtime.cost.hardware import get_profile
from zeroc.tuning.tune_screen import screen
from zeroc.tuning.tune_space import Candidate
from zeroc.world.model_profile import profile_model
from zeroc.world.world_plan import plan_world

transformers = pytest.importorskip("transformers")

HARDWARE = get_profile("h100-sxm")


def _llama(layers: int, hidden: int, ffn: int, heads: int, vocab: int,
           seq: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
        use_cache=False, tie_word_embeddings=False, attn_implementation="eager")
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def _candidate(pp: int, schedule: str, microbatches: int, fused_loss: bool) -> Candidate:
    return Candidate(3, pp, tuple(sorted({
        "schedule": schedule, "microbatches": microbatches, "fused_loss": fused_loss,
        "partitioner": "min_cut", "bucket_mb": 25.0}.items())))


def _screened_and_planned(model: torch.nn.Module, inputs: dict, world: int,
                          layouts: list[Candidate]) -> list[tuple[int, int]]:
    profile = profile_model(model, inputs, "cuda")
    found = []
    for candidate in layouts:
        screened = screen(profile, candidate, world, HARDWARE).peak_bytes
        plan = plan_world(model, inputs, world=world, pp=candidate.pp, zero=candidate.zero,
                          device="cuda", options=candidate.options_dict())
        found.append((screened, max(m.peak for m in plan.memory)))
    return found


def test_the_logits_are_the_loss_heads_not_the_largest_output() -> None:
    """With 4 heads over 512 tokens and a vocabulary of 1000, each row's attention scores
    (4 MiB) outweigh its logits (2 MiB): the profile still names the logits, the screen keeps
    the scores the fused loss cannot free, and a narrow Llama's screened peaks are within 10%
    of its planned ones (the largest output taken for the logits screened 45% of the plan)."""
    model = _llama(layers=4, hidden=256, ffn=704, heads=4, vocab=1000, seq=512)
    tokens = torch.zeros(8, 512, dtype=torch.long)
    inputs = {"input_ids": tokens, "labels": tokens}
    profile = profile_model(model, inputs, "cuda")
    scores = 8 * 4 * 512 * 512 * 4
    assert max(op.out_bytes for op in profile.forward) == scores
    assert profile.logits_bytes() == 8 * 512 * 1000 * 4
    assert len(profile.block_starts) == 4  # the stage split cuts in front of each layer
    layouts = [_candidate(2, "1f1b", 4, True), _candidate(2, "dualpipev", 4, False)]
    for (screened, planned), candidate in zip(
            _screened_and_planned(model, inputs, 8, layouts), layouts, strict=True):
        assert 0.9 < screened / planned < 1.1, (candidate.label(), screened, planned)


@pytest.mark.slow
def test_a_7b_layers_screened_peak_is_within_10_percent_of_its_plan() -> None:
    """A Llama of 7B's layer (hidden 4096, 32 heads, FFN 11008, vocabulary 32000) cut short to
    8 layers, 16 x 2048 tokens at world 32: a 1F1B and a DualPipeV layout at pp=4 screen within
    10% of their plans (each about 24 GiB; DualPipeV's ranks hold many micro-batches of one
    stage and few of the other, the loss's)."""
    model = _llama(layers=8, hidden=4096, ffn=11008, heads=32, vocab=32000, seq=2048)
    tokens = torch.zeros(16, 2048, dtype=torch.long)
    layouts = [_candidate(4, "1f1b", 8, True), _candidate(4, "dualpipev", 8, False)]
    found = _screened_and_planned(model, {"input_ids": tokens, "labels": tokens}, 32, layouts)
    for (screened, planned), candidate in zip(found, layouts, strict=True):
        assert 0.9 < screened / planned < 1.1, (candidate.label(), screened, planned)
        assert planned > 20 * 2**30  # a large model's step: tens of GiB
