"""A multi-layer perceptron: a stack of Linear + GELU layers with an MSE or cross-entropy loss."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from . import init_parameters

LOSSES = ("mse", "cross_entropy")


@dataclass(frozen=True)
class MLPConfig:
    """Sizes of an MLP: ``n_layer`` hidden Linear+GELU layers of width ``hidden``, then a head.

    loss: "mse" (targets are float tensors shaped like the output) or "cross_entropy"
        (targets are class indices in ``[0, out_features)``).
    """

    in_features: int = 16
    hidden: int = 32
    out_features: int = 8
    n_layer: int = 2
    loss: str = "mse"

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"MLPConfig: loss={self.loss!r} is not supported; allowed: {LOSSES}")
        for name in ("in_features", "hidden", "out_features", "n_layer"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"MLPConfig: {name}={value!r} must be a positive integer")


class MLP(nn.Module):
    """``layers.{i}`` are Linear layers each followed by GELU; ``head`` maps to the outputs."""

    def __init__(self, config: MLPConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.config = config if config is not None else MLPConfig()
        cfg = self.config
        widths = [cfg.in_features] + [cfg.hidden] * cfg.n_layer
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in pairwise(widths))
        self.head = nn.Linear(widths[-1], cfg.out_features)
        init_parameters(self, seed, std=0.2)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Return the outputs ``(batch, out_features)``, or the mean loss given ``targets``."""
        for layer in self.layers:
            x = F.gelu(layer(x))
        out = self.head(x)
        if targets is None:
            return out
        if self.config.loss == "mse":
            return F.mse_loss(out, targets)
        return F.cross_entropy(out, targets)

    def example_batch(
        self, batch_size: int = 4, seed: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A deterministic ``(inputs, targets)`` pair for this model's config."""
        generator = torch.Generator().manual_seed(seed)
        cfg = self.config
        x = torch.randn(batch_size, cfg.in_features, generator=generator)
        if cfg.loss == "mse":
            y = torch.randn(batch_size, cfg.out_features, generator=generator)
        else:
            y = torch.randint(0, cfg.out_features, (batch_size,), generator=generator)
        return x, y
