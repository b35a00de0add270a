"""A planned rank's parameter tensors, made without dispatching an op.

In the fake world (``zeroc.world.fake_world``) ``zeroc.parallelize`` makes, for every parameter of
the model, a flat buffer and a visible parameter over this rank's rows of it. Made with
tensor ops, that is about eight ops per parameter, and fake tensor mode spends 100-200 µs on
each (it hashes every call for its cache): a second per pipeline position of a 70B model
(723 parameters), for tensors that hold no values.

The same tensors are made here directly, as the ops would leave them:

- a flat buffer: a meta tensor of its size wrapped as a ``FakeTensor`` of the active mode
  (what fake tensor mode does with an op's meta output), marked a parameter the way
  ``nn.Parameter`` marks a tensor subclass (``requires_grad_`` and ``_is_param``);
- a visible parameter: a meta view of the flat buffer's storage (same storage, offset, shape
  and contiguous strides as ``flat[start:start + n].view(shape)``), wrapped the same way, then
  for a DTensor placed with the ``DTensorSpec`` that ``DTensor.from_local`` builds.

Nothing here has an autograd history, as a parameter has none. ``tests/test_fake_params.py``
checks these tensors against the dispatched ones property by property, and that a planned
world gives the same plan either way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroc.runtime.step_memory import note_made
from zeroc.runtime.torch_compat import (
    FakeTensor,
    FakeTensorMode,
    detect_fake_mode,
    disable_current_modes,
    make_contiguous_strides_for,
)

__all__ = ["active_fake_mode", "fake_empty", "fake_flat", "fake_visible"]


def active_fake_mode() -> FakeTensorMode | None:
    """The fake tensor mode in effect here (``zeroc.world.fake_world``'s), if any."""
    mode = detect_fake_mode()
    return mode if isinstance(mode, FakeTensorMode) else None


def _as_parameter(tensor: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    # What ``nn.Parameter(t, requires_grad)`` does with a tensor subclass, minus the detach
    # (``tensor`` is new and has no history).
    tensor.requires_grad_(requires_grad)
    tensor._is_param = True  # type: ignore[attr-defined]
    return tensor  # type: ignore[return-value]


def fake_empty(mode: FakeTensorMode, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)`` on ``mode``'s fake tensors."""
    with disable_current_modes():
        return FakeTensor(mode, torch.empty(shape, dtype=dtype, device="meta"), device)


def fake_flat(mode: FakeTensorMode, numel: int, dtype: torch.dtype, device: torch.device,
              requires_grad: bool) -> nn.Parameter:
    """``nn.Parameter(torch.empty(numel, dtype=dtype, device=device), requires_grad)`` on
    ``mode``'s fake tensors. A whole-run ledger (``zeroc.world.device_allocations``) counts it as
    the op would have been counted."""
    flat = _as_parameter(fake_empty(mode, (numel,), dtype, device), requires_grad)
    note_made(flat, "parameter shard")
    return flat


def fake_visible(mode: FakeTensorMode, sharded: Any) -> nn.Parameter:
    """``sharded``'s visible parameter over its flat buffer, as ``_shard`` makes it with
    ``nn.Parameter(sharded.wrap(sharded.local_view(flat.detach())))``: this rank's rows
    (``ShardedParam.local_layout``) as a plain tensor, or placed on ``dp_mesh`` as a DTensor
    of the parameter's whole shape (the spec ``DTensor.from_local(..., shape=, stride=)``
    builds)."""
    flat = sharded.flat
    offset, local_shape = sharded.local_layout()
    with disable_current_modes():
        meta = torch.empty(0, dtype=flat.dtype, device="meta")
        meta.set_(flat.untyped_storage(), flat.storage_offset() + offset, local_shape,
                  make_contiguous_strides_for(local_shape))
        local = FakeTensor(mode, meta, flat.device)
    placement = sharded.dtensor_placement()
    if placement is None:
        return _as_parameter(local, flat.requires_grad)
    from torch.distributed.tensor import DTensor

    from zeroc.runtime.torch_compat import DTensorSpec, TensorMeta

    shape = torch.Size(sharded.record.shape)
    spec = DTensorSpec(sharded.dp_mesh, (placement,), tensor_meta=TensorMeta(
        shape, make_contiguous_strides_for(shape), flat.dtype))
    visible = DTensor(local, spec, requires_grad=flat.requires_grad)  # type: ignore[call-arg]
    visible._is_param = True  # type: ignore[attr-defined]
    return visible  # type: ignore[return-value]
