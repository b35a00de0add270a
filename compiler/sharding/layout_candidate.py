"""A layout as zeroc chooses one: the ZeRO stage, the pipeline depth and the compile options
(``Candidate``), and the key of the model and inputs it was chosen for (``model_key``).

``zeroc.tune`` searches candidates; ``parallelize(layout="auto")`` reads the one it kept
(``zeroc.sharding.tune_cache``), so both live below the tuner.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch
from torch import nn

__all__ = ["Candidate", "model_key"]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout and its compile options."""

    zero: int
    pp: int
    options: tuple[tuple[str, Any], ...] = ()
    offload: str | None = None  # parallelize's ``offload`` ("optimizer": ZeRO-Offload)

    def options_dict(self) -> dict[str, Any]:
        """The compile options for ``torch.compile(..., backend="zeroc", options=...)``."""
        return dict(self.options)

    def label(self) -> str:
        """A short readable name: ``zero3 pp1 fused_loss=False``."""
        parts = [f"zero{self.zero}", f"pp{self.pp}"]
        parts += [f"{k}={v}" for k, v in self.options]
        if self.offload:
            parts.append(f"offload={self.offload}")
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        """JSON-able form (``from_json`` inverts it)."""
        found = {"zero": self.zero, "pp": self.pp, "options": dict(self.options)}
        if self.offload:
            found["offload"] = self.offload
        return found

    @staticmethod
    def from_json(data: dict[str, Any]) -> Candidate:
        """Inverse of ``to_json``."""
        return Candidate(int(data["zero"]), int(data["pp"]),
                         tuple(sorted(dict(data.get("options", {})).items())),
                         data.get("offload"))


def model_key(model: nn.Module, example_inputs: Any) -> str:
    """A hash of what decides the compiled graphs: module classes, parameters, input shapes."""
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        digest.update(f"{name}:{type(module).__qualname__};".encode())
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
    values = example_inputs.values() if isinstance(example_inputs, dict) else (
        example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,))
    for value in values:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else repr(value)
        digest.update(f"in:{shape};".encode())
    return digest.hexdigest()[:16]
