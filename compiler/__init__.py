"""zeroc: a torch.compile backend for ZeRO-sharded, pipelined training with a readable plan.

``parallelize``, ``calibrate``, ``explain``, ``tune``, ``full_state_dict`` and
``load_full_state_dict`` are imported at once: the functions ``parallelize``, ``calibrate``,
``explain`` and ``tune`` share their names with their submodules, and importing a submodule
later would otherwise replace the function on this package. The rest is imported lazily so
that ``import zeroc.runtime`` (which runs this file first) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zeroc.calibrate import calibrate
from zeroc.explain import explain
from zeroc.log_setup import register_logging
from zeroc.parallelize import parallelize
from zeroc.state_dict import full_state_dict, load_full_state_dict
from zeroc.tune import tune

register_logging()  # TORCH_LOGS="zeroc" / "+zeroc" turns zeroc's loggers on

if TYPE_CHECKING:
    from zeroc.config import Config
    from zeroc.runtime.plan import Plan
    from zeroc.runtime.zero_ops import MixedPrecision
    from zeroc.training import (
        clip_grad_norm_,
        data_parallel_rank,
        data_parallel_size,
        no_sync,
        set_requires_gradient_sync,
    )

__all__ = [
    "Config",
    "MixedPrecision",
    "Plan",
    "calibrate",
    "clip_grad_norm_",
    "data_parallel_rank",
    "data_parallel_size",
    "explain",
    "full_state_dict",
    "load_full_state_dict",
    "no_sync",
    "parallelize",
    "set_requires_gradient_sync",
    "tune",
]

_LAZY = {
    "Config": ("zeroc.config", "Config"),
    "MixedPrecision": ("zeroc.runtime.zero_ops", "MixedPrecision"),
    "Plan": ("zeroc.runtime.plan", "Plan"),
    "clip_grad_norm_": ("zeroc.training", "clip_grad_norm_"),
    "data_parallel_rank": ("zeroc.training", "data_parallel_rank"),
    "data_parallel_size": ("zeroc.training", "data_parallel_size"),
    "no_sync": ("zeroc.training", "no_sync"),
    "set_requires_gradient_sync": ("zeroc.training", "set_requires_gradient_sync"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'zeroc' has no attribute {name!r}")
    import importlib

    module_name, attr = _LAZY[name]
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value
