"""A small zoo of plain ``nn.Module`` models that the tests and benchmarks compile.

Every model takes its sizes from a config dataclass, initialises its parameters
deterministically from a seed (independent of the global RNG), and has
``forward(x, targets=None)``: the mean loss when targets are given, else the outputs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["init_parameters"]


def init_parameters(module: nn.Module, seed: int, std: float = 0.02) -> None:
    """Re-initialise every parameter of ``module`` from a private generator seeded by ``seed``.

    Linear and Embedding weights get N(0, std); Conv2d weights get Kaiming-normal (fan-in);
    biases get zeros; norm weights ones; any other module's 1-D ``weight`` parameter (a custom
    norm) gets ones too. Tied parameters are initialised once, at their first owner. The global
    RNG is not touched, so building a model never changes the caller's random stream.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    seen: set[int] = set()

    def fill_normal(tensor: torch.Tensor, tensor_std: float) -> None:
        if id(tensor) in seen:
            return
        seen.add(id(tensor))
        sample = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        sample.normal_(0.0, tensor_std, generator=generator)
        tensor.copy_(sample)

    def fill_constant(tensor: torch.Tensor, value: float) -> None:
        if id(tensor) in seen:
            return
        seen.add(id(tensor))
        tensor.fill_(value)

    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, (nn.Linear, nn.Embedding)):
                fill_normal(sub.weight, std)
            elif isinstance(sub, nn.Conv2d):
                fan_in = sub.in_channels // sub.groups * math.prod(sub.kernel_size)
                fill_normal(sub.weight, math.sqrt(2.0 / fan_in))
            elif isinstance(sub, (nn.LayerNorm, nn.BatchNorm2d, nn.RMSNorm)):
                if sub.weight is not None:
                    fill_constant(sub.weight, 1.0)
            else:
                weight = getattr(sub, "weight", None)
                if isinstance(weight, nn.Parameter) and weight.dim() == 1:
                    fill_constant(weight, 1.0)
            bias = getattr(sub, "bias", None)
            if isinstance(bias, nn.Parameter):
                fill_constant(bias, 0.0)
