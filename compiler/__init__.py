"""zeroc: a torch.compile backend for ZeRO-sharded, pipelined training with a readable plan.

Public names are imported lazily so that ``import zeroc.runtime`` (which runs this file first)
stays light and free of import cycles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zeroc.config import Config
    from zeroc.explain import explain
    from zeroc.runtime.plan import Plan

__all__ = ["Config", "Plan", "explain"]

_LAZY = {
    "Config": ("zeroc.config", "Config"),
    "Plan": ("zeroc.runtime.plan", "Plan"),
    "explain": ("zeroc.explain", "explain"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'zeroc' has no attribute {name!r}")
    import importlib

    module_name, attr = _LAZY[name]
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value
