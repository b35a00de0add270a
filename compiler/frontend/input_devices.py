"""The batch's device against the process group's: a forward pre-hook of a parallelized model.

Where the process group moves CUDA tensors (NCCL), a batch tensor left on the CPU reaches a
pipeline's transfers and batch checks, or the compute beside CUDA parameters; NCCL aborts
the job on the first ("Tensors must be CUDA and dense") and torch names no input on the
second. The hook refuses it before anything runs, naming the input. It runs before Dynamo's
frame (a root module's hooks run outside ``torch.compile``'s graph), on the host, reading
only each tensor's device: no device work, no sync.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from zeroc.runtime.torch_compat import keystr, tree_flatten_with_path

__all__ = ["install_input_device_check"]


def _refuse_cpu_batch(device: torch.device, names: list[str]) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        leaves, _ = tree_flatten_with_path((args, kwargs))
        for path, value in leaves:
            # A 0-dimensional CPU tensor is a scalar torch moves itself.
            if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim():
                raise ValueError(
                    f"zeroc: the model's input {_name(path, names)} is a tensor of shape "
                    f"{list(value.shape)} on the CPU, but the process group's collectives "
                    f"run on {device} (NCCL takes CUDA tensors only): move the batch to the "
                    f"GPU first (.to({str(device)!r}))")
    return hook


def _name(path: tuple, names: list[str]) -> str:
    """``x`` for the first positional argument of ``forward(x, y)``; ``labels=`` for a
    keyword; the pytree path inside a nested input."""
    where, *inside = path
    index = getattr(path[1], "idx", None) if len(path) > 1 else None
    key = getattr(path[1], "key", None) if len(path) > 1 else None
    if getattr(where, "idx", None) == 0 and index is not None:
        base = names[index] if index < len(names) else f"argument {index}"
        rest = path[2:]
    elif key is not None:
        base, rest = f"{key}=", path[2:]
    else:
        return keystr(path)
    return base + (keystr(tuple(rest)) if rest else "")


def install_input_device_check(model: nn.Module, device: torch.device) -> None:
    """Refuse CPU batch tensors on ``model``'s calls when ``device`` (the group's) is CUDA."""
    if device.type != "cuda":
        return
    try:
        names = [p.name for p in inspect.signature(model.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    model.register_forward_pre_hook(_refuse_cpu_batch(device, names), with_kwargs=True,
                                    prepend=True)
