"""A small convolutional classifier with BatchNorm, whose running statistics are mutable buffers."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from . import init_parameters


@dataclass(frozen=True)
class CNNConfig:
    """Sizes of the CNN: one conv-BN-ReLU block per entry of ``channels``.

    The first blocks are followed by 2x2 max pooling, the last by global average pooling;
    ``image_size`` must be divisible by ``2 ** (len(channels) - 1)``. ``bn_momentum=None`` makes
    BatchNorm keep a cumulative average, which reads ``num_batches_tracked``.
    """

    in_channels: int = 3
    channels: tuple[int, ...] = (8, 16)
    num_classes: int = 10
    image_size: int = 8
    bn_momentum: float | None = 0.1

    def __post_init__(self) -> None:
        if not self.channels:
            raise ValueError("CNNConfig: channels=() must name at least one block width")
        factor = 2 ** (len(self.channels) - 1)
        if self.image_size % factor != 0:
            raise ValueError(
                f"CNNConfig: image_size={self.image_size} must be divisible by {factor} "
                f"(one 2x2 pooling per block after the first of {len(self.channels)})"
            )


class ConvBlock(nn.Module):
    """Conv2d (3x3, same padding, no bias) -> BatchNorm2d -> ReLU."""

    def __init__(self, in_channels: int, out_channels: int, bn_momentum: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels, momentum=bn_momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to an NCHW tensor."""
        return F.relu(self.bn(self.conv(x)))


class CNN(nn.Module):
    """``layers.{i}`` conv blocks, max pooling between them, global average pool, ``head``."""

    def __init__(self, config: CNNConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.config = config if config is not None else CNNConfig()
        cfg = self.config
        widths = (cfg.in_channels, *cfg.channels)
        self.layers = nn.ModuleList(ConvBlock(a, b, cfg.bn_momentum) for a, b in pairwise(widths))
        self.head = nn.Linear(widths[-1], cfg.num_classes)
        init_parameters(self, seed, std=0.1)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Return logits ``(batch, num_classes)``, or the mean cross-entropy with ``targets``."""
        last = len(self.layers) - 1
        for i, block in enumerate(self.layers):
            x = block(x)
            if i < last:
                x = F.max_pool2d(x, 2)
        logits = self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets)

    def example_batch(
        self, batch_size: int = 4, seed: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A deterministic ``(images, labels)`` pair for this model's config."""
        generator = torch.Generator().manual_seed(seed)
        cfg = self.config
        x = torch.randn(
            batch_size, cfg.in_channels, cfg.image_size, cfg.image_size, generator=generator
        )
        y = torch.randint(0, cfg.num_classes, (batch_size,), generator=generator)
        return x, y
