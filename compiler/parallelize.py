"""``zeroc.parallelize``: shard a model's parameters in place for ZeRO data parallelism.

Stages 1-3: every parameter is replaced by this rank's flat shard (an ``nn.Parameter``, the
tensor the optimizer sees) behind a ``torch.nn.utils.parametrize`` parametrization whose forward
is ``zeroc::unshard``; its backward ``zeroc::reduce_grad`` lands the averaged gradient shard in
``shard.grad``. In eager mode every stage gathers a weight where it is used; the stages differ
in how gradients are reduced (stage 1 all-reduces full gradients, stages 2-3 reduce-scatter).
Where weights stay resident and when they are gathered again is decided by the compiler.

Stage 0 is plain data parallelism: the "shard" is the whole flat parameter, unshard only
reshapes it, and its backward ``zeroc::reduce_grad`` all-reduces (averages) the gradient over
the data-parallel group, so the compiler sees the reduction in the graph and buckets it.

Naming: ``model.named_parameters()`` shows the shards as ``<module>.parametrizations.<name>
.original`` (torch's parametrize names); ``model.state_dict()`` keeps the original keys (e.g.
``blocks.0.fc.weight``) with the LOCAL SHARD as value, and ``load_state_dict`` accepts such a
dict. ``zeroc.full_state_dict`` / ``zeroc.load_full_state_dict`` deal in full tensors.

Tied parameters (one ``nn.Parameter`` in several modules) become one shard shared by a
parametrization on each owner; autograd sums the gradient contributions into that shard.

Meta-device models: for each module in ``model.modules()`` order whose direct parameters are
on the meta device, those parameters are allocated full-size on the compute device and the
module's own ``reset_parameters()`` fills them (a parameter already materialized through a tie
gets a scratch tensor, so the random stream advances exactly as during a normal construction);
the full tensor is then cut and only this rank's shard is kept. For models whose parameters live
in leaf modules with ``reset_parameters()`` (Linear, Embedding, LayerNorm, ...) this reproduces
a normal initialization under the same seed. A meta parameter whose module has no
``reset_parameters()`` and meta buffers are errors. On every path each parameter is broadcast
from the first rank of its data-parallel group, so all replicas start identical.

``mixed_precision="bf16"``: shards stay fp32 (the optimizer's master copy); the shard is cast to
bf16 before the gather (half the traffic), compute runs in bf16, gradients are reduced in bf16
and the cast's backward returns them to the fp32 shards. Floating-point inputs of the model's
forward are cast to bf16 by a forward pre-hook.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Container

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize
from torch.utils._pytree import tree_map

from zeroc.runtime.mesh import Mesh, build_mesh
from zeroc.runtime.zero_ops import (
    ZERO_STAGES,
    ParamShard,
    ZeroLayout,
    padded_numel_for,
    shard_of,
    unshard,
)

__all__ = ["parallelize", "layout_of", "MIXED_PRECISION_MODES"]

LAYOUT_ATTR = "_zeroc_layout"
PARAM_ATTR = "_zeroc_param"
MIXED_PRECISION_MODES = (None, "bf16")
_COMPUTE_DTYPES = {None: None, "bf16": torch.bfloat16}


class UnshardParametrization(nn.Module):
    """``module.<name>`` = the full weight gathered from this rank's flat shard."""

    def __init__(
        self,
        shape: tuple[int, ...],
        numel: int,
        group_name: str,
        zero_stage: int,
        compute_dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.shape = tuple(shape)
        self.numel = numel
        self.group_name = group_name
        self.zero_stage = zero_stage
        self.compute_dtype = compute_dtype

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        """Gather the full weight (in the compute dtype when one is set)."""
        if self.compute_dtype is not None:
            shard = shard.to(self.compute_dtype)
        return unshard(shard, self.shape, self.numel, self.group_name, self.zero_stage)

    def extra_repr(self) -> str:
        return f"shape={self.shape}, zero={self.zero_stage}, group={self.group_name!r}"


def layout_of(model: nn.Module) -> ZeroLayout | None:
    """The layout ``parallelize`` recorded on ``model``, or ``None`` if it was not called."""
    return getattr(model, LAYOUT_ATTR, None)


def _validate(model: nn.Module, zero: int, mixed_precision: str | None) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__} is not allowed: pass an nn.Module")
    existing = layout_of(model)
    if existing is not None:
        raise ValueError(
            f"model is already parallelized (zero={existing.zero}, pp={existing.pp}): "
            "call zeroc.parallelize once per model"
        )
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ValueError(f"zero={zero!r} is not allowed: zero must be one of 0, 1, 2, 3")
    if mixed_precision not in MIXED_PRECISION_MODES:
        raise ValueError(
            f"mixed_precision={mixed_precision!r} is not allowed: use None or 'bf16'"
        )
    seen: set[int] = set()
    for path, module in model.named_modules():
        if parametrize.is_parametrized(module):
            raise ValueError(
                f"model: module {path or '<root>'!r} already has parametrizations; "
                "zeroc.parallelize needs plain parameters"
            )
        params = [(n, p) for n, p in module._parameters.items() if p is not None]
        meta = [n for n, p in params if p.is_meta and id(p) not in seen]
        seen.update(id(p) for _, p in params)
        if meta and not callable(getattr(module, "reset_parameters", None)):
            raise ValueError(
                f"parameter {_join(path, meta[0])!r} is on the meta device and its module "
                f"({type(module).__name__}) has no reset_parameters() to initialize it: give "
                "the module a reset_parameters() or build the model on a real device"
            )
    for path, buffer in model.named_buffers():
        if buffer.is_meta:
            raise ValueError(
                f"buffer {path!r} is on the meta device: zeroc.parallelize materializes "
                "parameters only; create buffers on a real device"
            )


def _materialize_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _materialize_direct(
    module: nn.Module, device: torch.device, done: Container[int]
) -> dict[str, torch.Tensor]:
    """Full tensors for ``module``'s direct meta parameters, filled by ``reset_parameters``."""
    params = {n: p for n, p in module._parameters.items() if p is not None}
    reset = getattr(module, "reset_parameters", None)
    # _validate made sure a module owning a meta parameter first can reset it; a module that
    # only re-uses tied parameters materialized earlier may lack reset_parameters.
    if not any(p.is_meta for p in params.values()) or not callable(reset):
        return {}
    scratch = {
        n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
        for n, p in params.items()
    }
    try:
        module._parameters.update(scratch)
        with torch.no_grad():
            reset()
    finally:
        module._parameters.update(params)
    return {n: scratch[n].detach() for n, p in params.items() if p.is_meta and id(p) not in done}


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _broadcast_from_dp_root(tensor: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    tensor = tensor.detach()
    if mesh.dp > 1:
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        dist.broadcast(tensor, src=mesh.dp_group_ranks[0], group=mesh.dp_group())
    return tensor


def _state_dict_hooks(module: nn.Module, renamed: tuple[str, ...]) -> None:
    """Keep original keys (``fc.weight``) in ``state_dict``/``load_state_dict`` of ``module``."""
    order = tuple(n for n, p in module._parameters.items() if p is not None) + renamed
    stored = {n: f"parametrizations.{n}.original" for n in renamed}

    def save_original_names(mod, state_dict, prefix, local_metadata) -> None:
        subtree = [k for k in state_dict if k.startswith(prefix)]
        items = {k: state_dict.pop(k) for k in subtree}
        for name in renamed:
            key = prefix + stored[name]
            if key in items:
                items[prefix + name] = items.pop(key)
        for name in dict.fromkeys(order):
            if prefix + name in items:
                state_dict[prefix + name] = items.pop(prefix + name)
        state_dict.update(items)

    def load_original_names(mod, state_dict, prefix, *unused) -> None:
        for name in renamed:
            if prefix + name in state_dict:
                state_dict[prefix + stored[name]] = state_dict.pop(prefix + name)

    module.register_state_dict_post_hook(save_original_names)
    module.register_load_state_dict_pre_hook(load_original_names)


def _cast_inputs_hook(dtype: torch.dtype):
    def cast(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    def cast_inputs(module, args, kwargs):
        return tree_map(cast, args), tree_map(cast, kwargs)

    return cast_inputs


def parallelize(
    model: nn.Module, zero: int = 3, pp: int = 1, mixed_precision: str | None = None
) -> nn.Module:
    """Shard ``model``'s parameters in place over the data-parallel group; return ``model``.

    ``zero`` is the ZeRO stage (0: replicate and average gradients; 1: shard optimizer state;
    2: + gradients; 3: + parameters). ``pp`` pipeline positions split the world into
    ``world // pp`` data-parallel ranks each (the pipeline split itself is done by the
    compiler). ``mixed_precision`` is ``None`` or ``"bf16"``. Without an initialized process
    group the world is one rank. Every rank must call this with the same arguments on the same
    model definition. The result is recorded as ``model._zeroc_layout`` (a ``ZeroLayout``); each
    parameter the optimizer sees carries the same ``_zeroc_layout`` and its own ``ParamShard`` as
    ``_zeroc_param``, so a compiler handed only the parameters can find both.
    """
    _validate(model, zero, mixed_precision)
    mesh = build_mesh(pp)
    compute_dtype = _COMPUTE_DTYPES[mixed_precision]
    device = _materialize_device()
    entries: dict[int, _Entry] = {}  # id(original parameter) -> what replaced it
    renamed_by_module: list[tuple[nn.Module, tuple[str, ...]]] = []
    wrapped = True
    for path, module in list(model.named_modules()):
        fresh = _materialize_direct(module, device, entries)
        renamed: list[str] = []
        for local, param in list(module._parameters.items()):
            if param is None:
                continue
            entry = entries.get(id(param))
            if entry is not None:
                entry.names.append(_join(path, local))
            else:
                full = _broadcast_from_dp_root(fresh.get(local, param), mesh)
                entry = _Entry(
                    replacement=_replacement(param, full, zero, mesh),
                    names=[_join(path, local)],
                    param_name=_join(path, f"parametrizations.{local}.original")
                    if wrapped
                    else _join(path, local),
                    shape=tuple(param.shape),
                )
                entries[id(param)] = entry
            module._parameters[local] = entry.replacement
            parametrization: nn.Module = UnshardParametrization(
                entry.shape, param.numel(), mesh.dp_group_name, zero, compute_dtype
            )
            parametrize.register_parametrization(module, local, parametrization, unsafe=True)
            renamed.append(local)
        if renamed:
            renamed_by_module.append((module, tuple(renamed)))
    for module, renamed in renamed_by_module:
        _state_dict_hooks(module, renamed)
    if compute_dtype is not None:
        model.register_forward_pre_hook(_cast_inputs_hook(compute_dtype), with_kwargs=True)
    layout = ZeroLayout(
        zero=zero,
        pp=mesh.pp,
        dp=mesh.dp,
        world=mesh.world,
        mixed_precision=mixed_precision,
        mesh=mesh,
        params=tuple(entry.record(zero, mesh.dp) for entry in entries.values()),
    )
    setattr(model, LAYOUT_ATTR, layout)
    # The backend finds the layout (pp, mesh) from the parameters Dynamo hands it.
    for entry, record in zip(entries.values(), layout.params, strict=True):
        setattr(entry.replacement, LAYOUT_ATTR, layout)
        setattr(entry.replacement, PARAM_ATTR, record)
    return model


@dataclasses.dataclass
class _Entry:
    """A parameter being parallelized: its replacement and every name it is known by."""

    replacement: nn.Parameter
    names: list[str]
    param_name: str
    shape: tuple[int, ...]

    def record(self, zero: int, dp: int) -> ParamShard:
        numel = math.prod(self.shape)
        return ParamShard(
            name=self.names[0],
            param_name=self.param_name,
            tied_names=tuple(self.names[1:]),
            shape=self.shape,
            dtype=str(self.replacement.dtype).removeprefix("torch."),
            numel=numel,
            padded_numel=numel if zero == 0 else padded_numel_for(numel, dp),
            shard_numel=self.replacement.numel(),
            requires_grad=self.replacement.requires_grad,
        )


def _replacement(
    param: nn.Parameter, full: torch.Tensor, zero: int, mesh: Mesh
) -> nn.Parameter:
    """The parameter that stands for ``param`` on this rank: its flat shard (stage 0: all of it)."""
    dp, index = (mesh.dp, mesh.dp_index) if zero > 0 else (1, 0)
    return nn.Parameter(shard_of(full, dp, index), param.requires_grad)
