"""zeroc: a torch.compile backend for ZeRO-sharded, pipelined training with a readable plan.

``parallelize``, ``calibrate``, ``explain``, ``tune``, ``full_state_dict`` and
``load_full_state_dict`` are imported at once: the functions ``parallelize``, ``calibrate``,
``explain`` and ``tune`` share their names with their submodules, and importing a submodule
later would otherwise replace the function on this package. The rest is imported lazily so
that ``import zeroc.runtime`` (which runs this file first) stays light.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any


def _interrupted_while_importing(signum: int, frame: Any) -> None:
    sys.stderr.write("python -m zeroc: interrupted\n")
    os._exit(130)


# ``python -m zeroc ...`` imports this package (and torch: seconds) before its __main__ can
# catch anything: a Ctrl-C meanwhile ends with one line and exit 130 instead of a traceback.
# Python sets sys.argv[0] to "-m" only while it locates the module it runs.
_PREVIOUS_SIGINT = None
if sys.argv[:1] == ["-m"] and threading.current_thread() is threading.main_thread():
    _PREVIOUS_SIGINT = signal.signal(signal.SIGINT, _interrupted_while_importing)

from zeroc.frontend.log_setup import register_logging  # noqa: E402
from zeroc.sharding.parallelize import parallelize  # noqa: E402
from zeroc.sharding.state_dict import full_state_dict, load_full_state_dict  # noqa: E402
from zeroc.tuning.calibrate import calibrate  # noqa: E402
from zeroc.tuning.tune import tune  # noqa: E402
from zeroc.world.explain import explain  # noqa: E402

register_logging()  # TORCH_LOGS="zeroc" / "+zeroc" turns zeroc's loggers on
if _PREVIOUS_SIGINT is not None:
    signal.signal(signal.SIGINT, _PREVIOUS_SIGINT)

if TYPE_CHECKING:
    from zeroc.frontend.config import Config
    from zeroc.runtime.layout import MixedPrecision
    from zeroc.runtime.plan.plan import Plan
    from zeroc.sharding.checkpoint import load_checkpoint, save_checkpoint
    from zeroc.sharding.residual_state import ReductionResiduals
    from zeroc.sharding.training import (
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
    "ReductionResiduals",
    "calibrate",
    "clip_grad_norm_",
    "data_parallel_rank",
    "data_parallel_size",
    "explain",
    "full_state_dict",
    "load_checkpoint",
    "load_full_state_dict",
    "no_sync",
    "parallelize",
    "save_checkpoint",
    "set_requires_gradient_sync",
    "tune",
]

_LAZY = {
    "Config": ("zeroc.frontend.config", "Config"),
    "MixedPrecision": ("zeroc.runtime.layout", "MixedPrecision"),
    "Plan": ("zeroc.runtime.plan.plan", "Plan"),
    "ReductionResiduals": ("zeroc.sharding.residual_state", "ReductionResiduals"),
    "clip_grad_norm_": ("zeroc.sharding.training", "clip_grad_norm_"),
    "load_checkpoint": ("zeroc.sharding.checkpoint", "load_checkpoint"),
    "save_checkpoint": ("zeroc.sharding.checkpoint", "save_checkpoint"),
    "data_parallel_rank": ("zeroc.sharding.training", "data_parallel_rank"),
    "data_parallel_size": ("zeroc.sharding.training", "data_parallel_size"),
    "no_sync": ("zeroc.sharding.training", "no_sync"),
    "set_requires_gradient_sync": ("zeroc.sharding.training", "set_requires_gradient_sync"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'zeroc' has no attribute {name!r}")
    import importlib

    module_name, attr = _LAZY[name]
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value
