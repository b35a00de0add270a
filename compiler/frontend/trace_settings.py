"""Dynamo settings a pipelined model needs before it is traced.

Three things, all set by ``zeroc.parallelize(model, pp=...)`` with ``pp > 1``: logging inside
the forward must not break the graph (``ignore_model_logging``), the batch dimension is
traced as a symbol so the pipeline can trace its stages at the micro-batch size
(``mark_batch_dynamic``, a forward pre-hook on the model), and Hugging Face's output-capturing
hooks are installed before Dynamo traces (``install_output_capture_hooks``, another pre-hook).

A pipeline needs the whole forward as one graph. Models log from inside their forward:
Hugging Face models call ``logger.warning_once`` (a ``functools.lru_cache`` wrapper Dynamo
cannot trace) on their first call, which breaks the graph in two. ``ignore_model_logging()``
adds the methods of ``logging.Logger`` to Dynamo's ignored logging functions
(``torch._dynamo.config.ignore_logger_methods``), so logging calls inside a compiled forward
are skipped instead of breaking the graph. It is global Dynamo configuration: it is set by
``zeroc.parallelize(model, pp=...)`` with ``pp > 1`` and logged once when it changes anything.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from torch import nn

from zeroc.runtime.torch_compat import dynamo_config, maybe_mark_dynamic, tree_flatten

logger = logging.getLogger(__name__)

# Logger methods a model may call in its forward (transformers adds the *_once variants).
_LOGGER_METHODS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "log",
                   "warning_once", "info_once", "warning_advice")


def ignore_model_logging() -> None:
    """Let Dynamo skip ``logging.Logger`` calls inside traced code instead of breaking."""
    config = dynamo_config
    name = next((n for n in ("ignore_logging_functions", "ignore_logger_methods")
                 if hasattr(config, n)), None)
    if name is None:  # a torch without the setting: logging calls still break the graph
        return
    current = set(getattr(config, name))
    wanted = {getattr(logging.Logger, m) for m in _LOGGER_METHODS if hasattr(logging.Logger, m)}
    if wanted <= current:
        return
    setattr(config, name, current | wanted)
    logger.info("zeroc: logging.Logger calls inside compiled code are skipped (torch._dynamo."
                "config.%s), so a model's logging does not split its graph", name)


def _mark_batch_dynamic(value: Any) -> None:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] > 1:
        maybe_mark_dynamic(value, 0)


@torch.compiler.disable
def mark_batch_dynamic(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a pipelined model: dimension 0 of every tensor input is dynamic.

    ``torch.compile(model)`` runs the root module's hooks before Dynamo traces its forward,
    so Dynamo then traces the batch size as a symbol and every value built from it (masks,
    position indices) is symbolic too: the pipeline specializes that graph at the
    micro-batch size instead of rewriting constants (``passes/front/specialize_shapes``). Where
    Dynamo must specialize the size anyway, it does (``maybe_mark_dynamic``) and the
    pipeline rewrites the static graph. Sizes 0 and 1 are never dynamic in Dynamo.
    """
    for value in tree_flatten((args, kwargs))[0]:
        _mark_batch_dynamic(value)


@torch.compiler.disable
def install_output_capture_hooks(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a pipelined model: install transformers' output-capturing hooks now.

    A Hugging Face model asked for outputs its layers record (``output_router_logits=True`` in
    an MoE config, so the router's auxiliary loss is part of the loss; ``output_hidden_states``)
    installs forward hooks on its layers lazily, on its first call, under a ``threading.Lock``
    (``transformers.utils.output_capturing.maybe_install_capturing_hooks``). Dynamo breaks the
    graph at the lock, and a pipeline needs one graph; installed before tracing, the hooks are
    traced like any other code. Only models that would install them on this call get them.
    """
    capturing = sys.modules.get("transformers.utils.output_capturing")
    registry = getattr(capturing, "_CAN_RECORD_REGISTRY", None)
    install = getattr(capturing, "maybe_install_capturing_hooks", None)
    if registry is None or install is None:
        return
    for sub in module.modules():
        flags = registry.get(sub) if hasattr(sub, "config") else None
        if not flags or getattr(sub, "_output_capturing_hooks_installed", False):
            continue
        if any(kwargs.get(f"output_{key}") or getattr(sub.config, f"output_{key}", False)
               for key in flags):
            install(sub)
