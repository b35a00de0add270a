"""The pipeline's loss normalization on one graph: a cross-entropy is proved a token mean and
rewritten into its sum however the call passed its arguments (``nn.CrossEntropyLoss`` and
some models pass them by position), and the denominator counts the non-ignored targets."""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn.functional as F

import zeroc.runtime.kernels.linear_cross_entropy  # noqa: F401  (the op the pass also reads)
from zeroc.passes.front.loss_normalization import LossReductionError, loss_to_numerator


class Positional(torch.nn.Module):
    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, targets, None, None, -1, None, "mean")


class Keyword(torch.nn.Module):
    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, targets, ignore_index=-1)


class Weighted(torch.nn.Module):
    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, targets, torch.ones(5))


@pytest.mark.parametrize("module", [Positional(), Keyword()], ids=["positional", "keyword"])
def test_a_cross_entropy_mean_becomes_its_sum_over_a_token_count(module) -> None:
    logits, targets = torch.randn(6, 5), torch.tensor([0, 1, -1, 3, -1, 4])
    gm = torch.fx.symbolic_trace(module)
    found = loss_to_numerator(gm, set(), None)
    assert found.kind == "token_mean"
    numerator = gm(logits, targets)
    count = found.denominator(logits, targets)
    assert float(count) == 4
    torch.testing.assert_close(numerator / count, module(logits, targets))
    torch.testing.assert_close(numerator, F.cross_entropy(logits, targets, ignore_index=-1,
                                                          reduction="sum"))


def test_class_weights_are_refused_naming_why() -> None:
    gm = torch.fx.symbolic_trace(Weighted())
    with pytest.raises(LossReductionError, match="cross_entropy with class weights"):
        loss_to_numerator(gm, set(), None)
