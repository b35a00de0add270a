"""One fake training step of the plain model, op by op: what ``zeroc.tune`` screens with.

``profile_model(model, example_inputs)`` runs the user's model (a meta copy, its parameters
made fake CPU tensors) forward and backward once under ``FakeTensorMode`` at one replica's
batch, and records every aten op the step dispatches: its FLOPs and bytes
(``zeroc.runtime.cost.cost.call_cost``), whether it is elementwise, which parameters it is the
first to read, and (for forward ops) how many of its output bytes autograd still holds when
the forward ends, i.e. what the backward needs. Nothing is compiled and no process group is
made, so this takes seconds where a plan of one layout takes tens of seconds; the tuner
screens every candidate layout on it (``zeroc.tuning.tune_screen``) and plans only the best in full.

Values never exist: a model that reads one (``.item()``, data-dependent branches) raises, as
planning does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from zeroc.runtime.cost.cost import call_cost, is_alias, is_pointwise, tensor_bytes
from zeroc.runtime.torch_compat import FakeTensorMode, TorchDispatchMode, tree_leaves

__all__ = ["ModelProfile", "OpRecord", "profile_model"]


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One forward op at the profiled batch: its cost, the output bytes the backward keeps
    (``saved``), the bytes of parameters it reads first (``param_bytes``), and whether it is
    elementwise (a recomputing partitioner recomputes it instead of saving its output)."""

    flops: int
    bytes: int
    saved: int
    param_bytes: int
    out_bytes: int
    pointwise: bool


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """A training step of the plain model at one replica's batch of ``rows`` rows."""

    rows: int
    forward: tuple[OpRecord, ...]
    backward: tuple[OpRecord, ...]  # saved and param_bytes are 0: nothing outlives the step
    param_bytes: int
    param_tensors: int

    def largest_output(self) -> int:
        """The largest single forward output (the logits of a language model)."""
        return max((op.out_bytes for op in self.forward), default=0)


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class _Recorder(TorchDispatchMode):
    """Records each op's cost; in the forward also its parameters and output storages."""

    def __init__(self, params: dict[int, int]) -> None:
        super().__init__()
        self.params = params  # storage key -> bytes, popped when first read
        self.backward = False
        self.ops: list[dict[str, Any]] = []
        self.backward_ops: list[OpRecord] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if is_alias(func) or func.overloadpacket in (torch.ops.aten.detach,):
            return out
        flops, moved = call_cost(func, args, kwargs, out)
        if self.backward:
            self.backward_ops.append(OpRecord(flops, moved, 0, 0, tensor_bytes(out),
                                              is_pointwise(func)))
            return out
        param_bytes = 0
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                param_bytes += self.params.pop(_storage_key(leaf), 0)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.ops.append({"flops": flops, "bytes": moved, "param_bytes": param_bytes,
                         "out_bytes": tensor_bytes(out), "pointwise": is_pointwise(func),
                         "refs": [(StorageWeakRef(t.untyped_storage()),
                                   t.untyped_storage().nbytes()) for t in outputs]})
        return out


def _fake_state(module: torch.nn.Module, device: torch.device) -> None:
    """Replace ``module``'s meta parameters and buffers by fake tensors on ``device`` (ties
    kept); called inside the fake mode."""
    made: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, value in table.items():
                if value is None:
                    continue
                if id(value) not in made:
                    empty = torch.empty(value.shape, dtype=value.dtype, device=device)
                    made[id(value)] = (torch.nn.Parameter(empty, value.requires_grad)
                                       if isinstance(value, torch.nn.Parameter) else empty)
                table[name] = made[id(value)]


def profile_model(model: torch.nn.Module, example_inputs: Any,
                  device: str = "cpu") -> ModelProfile:
    """Profile one training step of ``model`` on ``example_inputs`` (one replica's batch, a
    tuple or a dict) with fake tensors on ``device`` (``"cuda"`` works without a GPU, as
    planning does: kernels such as attention save what they save on that device); ``model``
    is not touched (a meta copy is used)."""
    from zeroc.world.fake_cuda import ensure_fake_cuda, fake_cuda_planning
    from zeroc.world.fake_world import _backward_for, _fake_inputs, loss_of, meta_copy

    replica = meta_copy(model)
    target = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        ensure_fake_cuda()
    planning = fake_cuda_planning() if device == "cuda" else contextlib.nullcontext()
    with planning, FakeTensorMode(allow_non_fake_inputs=False):
        _fake_state(replica, target)
        params = {}
        for param in replica.parameters():
            params.setdefault(_storage_key(param), param.untyped_storage().nbytes())
        total, tensors = sum(params.values()), len(params)

        args, kwargs = _fake_inputs(example_inputs, target)
        rows = next((int(v.shape[0]) for v in (*args, *kwargs.values())
                     if isinstance(v, torch.Tensor) and v.dim() > 0), 1)
        recorder = _Recorder(params)
        with recorder:
            loss = loss_of(replica(*args, **kwargs), "zeroc.tuning.tune")
        gc.collect()  # what the forward made and autograd does not hold is gone now
        seen: set[int] = set()
        forward = []
        for op in recorder.ops:
            saved = 0
            for ref, nbytes in op.pop("refs"):
                if not ref.expired() and ref.cdata not in seen:
                    seen.add(ref.cdata)
                    saved += nbytes
            forward.append(OpRecord(saved=saved, **op))
        recorder.backward = True
        with recorder:
            _backward_for(device)(loss)
    return ModelProfile(rows=rows, forward=tuple(forward),
                        backward=tuple(recorder.backward_ops), param_bytes=total,
                        param_tensors=tensors)
