"""Training-loop helpers for parallelized models: gradient sync switch and global-norm clipping.

- ``set_requires_gradient_sync(model, False)`` (also ``model.set_requires_gradient_sync``, as
  FSDP2 names it, and ``with zeroc.no_sync(model):``) makes the following backwards reduce no
  gradient: each rank accumulates its full local gradients. The first backward after sync is
  turned back on reduces them together with its own, one reduction per bucket, so k
  micro-steps give the gradient of the concatenated batch.
- ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` returns the global norm:
  for ``pp == 1`` the gradients are DTensors on the data-parallel mesh; with ``pp > 1`` each
  pipeline position holds only its stages' gradients and torch's norm is routed to
  ``zeroc.sharding.pipeline_clip``, which adds the positions' norms over the pipeline group (a
  parameter held by two positions is counted once). ``zeroc.clip_grad_norm_(model,
  max_norm)`` does the same from the model and clips every rank by the same factor.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from zeroc.sharding.parallelize import layout_of
from zeroc.sharding.pipeline_clip import owned_here, pipeline_norm
from zeroc.sharding.sharded_params import ZeroState, sharded_of, state_of
from zeroc.sharding.sharded_params import set_requires_gradient_sync as _set_sync

__all__ = ["clip_grad_norm_", "data_parallel_rank", "data_parallel_size", "no_sync",
           "set_requires_gradient_sync"]

logger = logging.getLogger(__name__)


def _state(model: nn.Module, what: str) -> ZeroState:
    model = getattr(model, "_orig_mod", model)  # a torch.compile wrapper
    state = state_of(model) if layout_of(model) is not None else None
    if state is None:
        raise ValueError(
            f"{what}: model {type(model).__name__} was not parallelized by zeroc: call "
            "zeroc.parallelize(model, zero=...) first"
        )
    return state


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Reduce gradients in the following backwards (``True``) or accumulate them locally."""
    state = _state(model, "set_requires_gradient_sync")
    _set_sync(state, requires_gradient_sync)
    logger.debug("gradient sync %s", "on" if requires_gradient_sync else "off")


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients without reducing them inside the block (DDP's ``no_sync``)."""
    state = _state(model, "no_sync")
    previous = state.requires_gradient_sync
    _set_sync(state, False)
    try:
        yield
    finally:
        _set_sync(state, previous)


def data_parallel_rank(model: nn.Module) -> int:
    """This rank's index on the data-parallel dimension: the rank to shard the data by.

    Every rank of one pipeline (same data-parallel index) must get the same batch:
    ``DistributedSampler(dataset, num_replicas=data_parallel_size(model),
    rank=data_parallel_rank(model))``.
    """
    model = getattr(model, "_orig_mod", model)
    layout = layout_of(model)
    return 0 if layout is None else layout.mesh.dp_index


def data_parallel_size(model: nn.Module) -> int:
    """The number of data-parallel replicas (world // pp); 1 if not parallelized."""
    model = getattr(model, "_orig_mod", model)
    layout = layout_of(model)
    return 1 if layout is None else layout.dp


def clip_grad_norm_(
    model: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip ``model``'s gradients by their global norm over every rank; return that norm.

    Equal to ``torch.nn.utils.clip_grad_norm_`` on the same model trained on one process with
    the global batch. Collective over the whole world: every rank must call it.
    """
    model = getattr(model, "_orig_mod", model)
    layout = layout_of(model)
    params = [p for p in model.parameters() if p.grad is not None]
    if layout is None or layout.pp == 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                              error_if_nonfinite, foreach)
        full_tensor = getattr(norm, "full_tensor", None)
        return full_tensor() if callable(full_tensor) else norm
    owned = [p.grad for p in params if owned_here(sharded_of(p), layout.mesh.pp_index)]
    device = (params[0].grad.device if params else
              layout.planned.device if layout.planned is not None else None)
    total = pipeline_norm(layout, owned, norm_type, error_if_nonfinite, foreach, device)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total
