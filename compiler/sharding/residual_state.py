"""A model's error-feedback residuals (``reduce_quant``): where its graphs keep them, and
``ReductionResiduals``, the ``Stateful`` that saves and restores them with DCP.

``reduce_quant="int8" | "int4"`` carries each step's rounding error of a gradient bucket into
the next step (``zeroc.runtime.quant.reduce``). Those residuals are state of the training
run, like the optimizer's moments: they live in a ``ResidualStore`` kept on the model's
``ZeroState`` (freed with the model; a new model starts from zero), and a resume that drops
them is not the run it resumes. They are not in ``model.state_dict()`` (which stays what
eager's is), so a checkpoint names them::

    state = {"model": get_model_state_dict(model), "residuals": zeroc.ReductionResiduals(model)}
    zeroc.save_checkpoint(state, path)     # and zeroc.load_checkpoint(state, path) to resume

A residual is this rank's own (its rounding of its own gradients, every rank's rows): each
rank saves its residuals under its own key, ``rank<r>`` (global rank), as one object of its
buckets' float32 tensors by bucket id, so loading needs no shapes known before the first
compile, and restores them before the graphs that read them are compiled. A resume must
run the same world and ``bucket_mb``: a bucket id that no graph names any more is unused.

``residual_scope`` is what the compile of one Dynamo graph passes its ZeRO lowering: the
token of the model's store and the full parameter name of each graph input, so a bucket is
named alike whether the model or one of its blocks was compiled.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroc.runtime.quant.reduce import ResidualScope, ResidualStore, store_of
from zeroc.sharding.sharded_params import STATE_ATTR, ZeroState

__all__ = ["ReductionResiduals", "residual_scope"]

log = logging.getLogger(__name__)

PARAM_ATTR = "_zeroc_param"  # zeroc.parallelize: a flat buffer's ParamShard


def residual_scope(example_inputs: Sequence[Any],
                   input_names: Mapping[str, str]) -> ResidualScope | None:
    """The residual scope of a Dynamo graph whose inputs are ``example_inputs`` (their names,
    ``primals_<i+1>`` -> the graph's own, in ``input_names``); ``None`` when no input is a
    parallelized model's flat buffer."""
    state = next((s for v in example_inputs
                  if isinstance(s := getattr(v, STATE_ATTR, None), ZeroState)), None)
    if state is None:
        return None
    names = {}
    for index, value in enumerate(example_inputs):
        record = getattr(value, PARAM_ATTR, None)
        known_as = input_names.get(f"primals_{index + 1}")
        if record is not None and known_as is not None:
            names[known_as] = record.name
    return ResidualScope(store_of(state).token, names)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class ReductionResiduals:
    """The error-feedback residuals of ``model`` (parallelized, compiled with
    ``reduce_quant``) as a DCP ``Stateful``: put it in the dict given to
    ``zeroc.save_checkpoint`` / ``zeroc.load_checkpoint`` (or ``dcp.save`` / ``dcp.load``)
    so a resume is the uninterrupted run (module docstring).

    ``state_dict()`` is ``{"rank<r>": bytes}``: this rank's residuals (``torch.save`` of a
    dict of CPU tensors by bucket id); ``load_state_dict`` replaces this rank's residuals by
    the saved ones (a checkpoint saved without any: all dropped). ``len()`` and ``nbytes``
    tell what this rank holds now."""

    def __init__(self, model: nn.Module) -> None:
        state = model.__dict__.get(STATE_ATTR)
        if not isinstance(state, ZeroState):
            raise TypeError(f"zeroc.ReductionResiduals: {type(model).__name__} was not "
                            "parallelized: call zeroc.parallelize(model, ...) first")
        self.store: ResidualStore = store_of(state)

    @property
    def key(self) -> str:
        """This rank's key in ``state_dict()``."""
        return f"rank{_rank()}"

    @property
    def nbytes(self) -> int:
        return self.store.nbytes()

    def __len__(self) -> int:
        return len(self.store)

    def clear(self) -> None:
        """Forget this model's residuals (its next reductions start from zero)."""
        self.store.clear()

    def state_dict(self) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save(self.store.state(), buffer)
        return {self.key: buffer.getvalue()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        saved = state_dict.get(self.key)
        if isinstance(saved, (bytes, bytearray)):
            saved = torch.load(io.BytesIO(saved), map_location="cpu", weights_only=True)
        if not isinstance(saved, Mapping):
            raise ValueError(f"zeroc.ReductionResiduals: no residuals of {self.key} in the "
                             f"state dict (keys: {sorted(state_dict)})")
        self.store.load(saved)
        log.debug("zeroc: restored %d error-feedback residuals (%d bytes)", len(self.store),
                  self.store.nbytes())
