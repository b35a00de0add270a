"""Bad input to a pipelined compile: each raises a ValueError that says what to do.

The pipeline cases need a pp=2 layout, so they run on 2 gloo ranks in one job; every case
fails while compiling, before any pipeline communication, and the job returns the messages.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from models.gpt import GPT, GPTConfig
from torch import nn


class LogitsGPT(GPT):
    """A GPT whose forward returns logits even when given targets."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(idx)


class BreakingGPT(GPT):
    """A GPT with a graph break between its blocks."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for i, block in enumerate(self.layers):
            x = block(x)
            if i == 0:
                torch._dynamo.graph_break()
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt(layers: int, cls: type[nn.Module] = GPT) -> nn.Module:
    return cls(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, d_model=32))


CASES = {
    "fewer_layers": (lambda: gpt(1), {"schedule": "1f1b"}, 8),
    "fewer_layers_dualpipev": (lambda: gpt(3), {"schedule": "dualpipev"}, 8),
    "microbatches": (lambda: gpt(2), {"microbatches": 3}, 8),
    "dualpipe_microbatches": (lambda: gpt(2), {"schedule": "dualpipe", "microbatches": 3}, 6),
    "not_a_loss": (lambda: gpt(2, LogitsGPT), {}, 8),
    "graph_break": (lambda: gpt(2, BreakingGPT), {}, 8),
}


def compile_errors(rank: int, world: int) -> dict[str, str]:
    from zeroc.sharding.parallelize import parallelize

    messages = {}
    for name, (build, options, batch) in CASES.items():
        torch._dynamo.reset()
        model = parallelize(build(), zero=0, pp=2)
        compiled = torch.compile(model, backend="zeroc", options=options)
        x, y = GPT.example_batch(model, batch)
        try:
            compiled(x, y)
        except ValueError as error:
            messages[name] = str(error)
        else:
            messages[name] = "no error"
    return messages


@pytest.fixture(scope="module")
def messages() -> dict[str, str]:
    first, second = run_ranks(compile_errors, 2, timeout=240)
    assert first == second
    return first


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("fewer_layers", "the model has 1 layers .* but 2 pipeline stages"),
        ("fewer_layers_dualpipev", "has 3 layers .* but 4 pipeline stages"),
        ("microbatches", "microbatches=3 does not divide the batch of 8"),
        ("dualpipe_microbatches", "dualpipe needs an even num_microbatches"),
        ("not_a_loss", "must return one scalar loss .* outputs are \\[\\(8, 16, 64\\) float32\\]"),
        # Dynamo gives up on the model's forward and compiles the embedding's on its own.
        ("graph_break", r"uses 1 of the model's 28 parameters \(it reads tok_emb\.weight\); "
                        "with pp=2 the whole forward must be one graph"),
    ],
)
def test_pipeline_input_errors(messages: dict[str, str], case: str, expected: str) -> None:
    assert messages[case] != "no error"
    assert re.search(expected, messages[case]), messages[case]


def test_unknown_schedule_lists_the_known_ones() -> None:
    model = gpt(2)
    compiled = torch.compile(model, backend="zeroc", options={"schedule": "interleaved"})
    with pytest.raises(ValueError, match="schedule='interleaved'.*known.*'dualpipev'"):
        compiled(*model.example_batch(2))


@pytest.mark.parametrize("value", [0, "4", True])
def test_bad_microbatches_option(value) -> None:
    model = gpt(2)
    compiled = torch.compile(model, backend="zeroc", options={"microbatches": value})
    with pytest.raises(ValueError, match="microbatches"):
        compiled(*model.example_batch(2))
