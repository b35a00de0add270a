"""Executes compiled graphs on this rank.

A ``GraphExecutor`` runs one functional graph produced by the pass pipeline. It uses the
boxed calling convention AOTAutograd expects: it empties the caller's argument list, so the
caller keeps no reference to inputs (saved activations) once the graph has run.
"""

from __future__ import annotations

from typing import Any

import torch.fx


class GraphExecutor:
    """Run a compiled functional ``GraphModule``; ``name`` is its name in the plan."""

    def __init__(self, gm: torch.fx.GraphModule, name: str) -> None:
        # An instance attribute, so that wrappers made with functools.wraps (Dynamo's
        # disable() around the backward) copy it and still call us boxed.
        self._boxed_call = True
        self.gm = gm
        self.name = name
        self.calls = 0

    def __call__(self, args: list[Any]) -> Any:
        self.calls += 1
        inputs = list(args)
        args.clear()
        return self.gm(*inputs)

    def __repr__(self) -> str:
        return f"GraphExecutor({self.name}, calls={self.calls})"
