"""``zeroc.parallelize``: shard a model's parameters in place for ZeRO data parallelism.

After ``parallelize(model, zero=S)`` every parameter of ``model`` is an ``nn.Parameter`` of its
original name and shape. With a process group and S >= 1 it holds a DTensor on the mesh's
``dp`` dimension with placement ``Shard(0)`` (FSDP2's layout: rank ``i`` owns rows
``[i*c, (i+1)*c)`` of dimension 0, ``c = ceil(d0 / dp)``; a 0-d parameter is ``Replicate()``),
so optimizers, ``clip_grad_norm_``, ``state_dict`` and DCP work as with FSDP2. At stage 0 (and
without a process group) parameters stay plain tensors. How a module reads its weights in the
forward, and how gradients reach the parameters, is described in ``zeroc.sharding.sharded_params``.

The stages (what each holds between steps, for Ψ fp32 parameters with AdamW on N ranks):

- 0: data parallel; whole parameters and gradients, gradients all-reduced: 16Ψ.
- 1: whole parameters and gradients (gradients all-reduced, as DDP), optimizer state for this
  rank's rows only; one all-gather after ``optimizer.step()`` shares the updated rows: 8Ψ + 8Ψ/N.
- 2: FSDP's SHARD_GRAD_OP: parameters gathered once per forward and kept for the backward,
  gradients reduce-scattered: 16Ψ/N at rest.
- 3: FSDP's FULL_SHARD: parameters gathered where used and again in the backward: 16Ψ/N.

Tied parameters (one ``nn.Parameter`` in several modules) stay one parameter; autograd sums
the gradient contributions.

Meta-device models: for each module in ``model.modules()`` order whose direct parameters are
on the meta device, those parameters are allocated full-size on the compute device and filled
by ``init_fn(module)``, the model's own per-module initializer or the module's
``reset_parameters()`` (see ``zeroc.sharding.meta_init``); the full tensor is then cut and only this
rank's rows are kept, so a rank never holds the whole model. On every path each parameter is
broadcast from the first rank of its data-parallel group, so all replicas start identical.
With ``pp > 1`` a meta model keeps no parameter at all here: its values are computed again
when the pipeline compiles, for this rank's stages only (``zeroc.sharding.deferred_init``); and
every pipeline rank, meta or not, frees the parameters of other ranks' stages then
(``zeroc.sharding.stage_holding``).

``mixed_precision``: ``zeroc.MixedPrecision(param_dtype=..., reduce_dtype=..., output_dtype=...)``
as FSDP2's ``MixedPrecisionPolicy``, or ``"bf16"`` for ``MixedPrecision(param_dtype=bfloat16)``.
The shards stay fp32 (the optimizer's master copy) and are cast before the gather.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from zeroc.frontend.input_devices import install_input_device_check
from zeroc.frontend.model_changes import install as track_requires_grad
from zeroc.frontend.trace_settings import (
    ignore_model_logging,
    install_output_capture_hooks,
    mark_batch_dynamic,
)
from zeroc.runtime.layout import MixedPrecision, ParamShard, ZeroLayout, mixed_precision_policy
from zeroc.runtime.mesh import Mesh, build_mesh, group_device, host_dp_mesh, is_fake_group
from zeroc.runtime.torch_compat import tree_map
from zeroc.runtime.world import PlannedWorld
from zeroc.runtime.zero_ops import (
    ZERO_STAGES,
    local_rows_for,
    padded_numel_for,
    row_numel,
    rows_per_shard,
    shard_of,
)
from zeroc.sharding.deferred_init import DeferredInit, has_meta_parameters
from zeroc.sharding.fake_params import active_fake_mode, fake_flat, fake_visible
from zeroc.sharding.meta_init import check_meta_initializable, materialize_direct
from zeroc.sharding.offload import check_offload, offload_rows
from zeroc.sharding.offload import install_hooks as install_offload_hooks
from zeroc.sharding.sharded_params import (
    STATE_ATTR,
    ShardedParam,
    UnshardSpec,
    ZeroState,
    ensure_step_hook,
    finish_modules,
    install,
    set_requires_gradient_sync,
)
from zeroc.sharding.stage_holding import FLAT_SHARDED_ATTR, install_state_dict_hooks
from zeroc.sharding.tune_cache import tuned_layout
from zeroc.sharding.whole_rows import after_optimizer_step, refresh_after_load

__all__ = ["parallelize", "layout_of", "MIXED_PRECISION_MODES", "MixedPrecision"]

log = logging.getLogger(__name__)

LAYOUT_ATTR = "_zeroc_layout"
PARAM_ATTR = "_zeroc_param"
MIXED_PRECISION_MODES = (None, "bf16")


def layout_of(model: nn.Module) -> ZeroLayout | None:
    """The layout ``parallelize`` recorded on ``model``, or ``None`` if it was not called."""
    return getattr(model, LAYOUT_ATTR, None)


def _validate(model: nn.Module, zero: int) -> None:
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
    for path, module in model.named_modules():
        if parametrize.is_parametrized(module):
            raise ValueError(
                f"model: module {path or '<root>'!r} already has parametrizations; "
                "zeroc.parallelize needs plain parameters"
            )


def _check_process_group(mesh: Any) -> None:
    """Refuse to run as a world of one when a launcher started several ranks.

    ``torchrun`` (and ``torch.distributed.launch``, SLURM wrappers, ...) set ``WORLD_SIZE``;
    without ``init_process_group`` every rank would silently train alone on its own data.
    """
    if mesh is not None or (dist.is_available() and dist.is_initialized()):
        return
    value = os.environ.get("WORLD_SIZE", "")
    try:
        world = int(value)
    except ValueError:
        return
    if world > 1:
        raise RuntimeError(
            f"zeroc.parallelize: WORLD_SIZE={value} is set (a launcher started {world} ranks) "
            "but no process group is initialized, so each rank would run alone as a world of "
            "1; call torch.distributed.init_process_group() ('nccl' on GPUs, 'gloo' on CPUs) "
            "before zeroc.parallelize, or unset WORLD_SIZE to run a single process"
        )


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` (a meta tensor stays: it is materialized or deferred)."""
    if tensor.is_meta or tensor.device == device:
        return tensor
    return tensor.detach().to(device)


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    """``module``'s own buffers on ``device`` (meta buffers are ``meta_init``'s)."""
    for name, buffer in module._buffers.items():
        if buffer is not None and not buffer.is_meta and buffer.device != device:
            module._buffers[name] = buffer.to(device)


def _broadcast_from_dp_root(tensor: torch.Tensor, mesh: Mesh,
                            planned: PlannedWorld | None) -> torch.Tensor:
    # The caller reads only its values (``_shard`` copies them out), so only a tensor that is
    # broadcast into needs to be detached first.
    # A planned rank's fake tensors hold no values: the broadcast is skipped, except for the
    # model as the user built it (``skip_init=False``), whose broadcast the device rule checks.
    if mesh.dp > 1 and (planned is None or not planned.simulated or not planned.skip_init):
        tensor = tensor.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        dist.broadcast(tensor, src=mesh.dp_group_ranks[0], group=mesh.dp_group())
    return tensor


def _cast_inputs_hook(dtype: torch.dtype):
    def cast(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    def cast_inputs(module, args, kwargs):
        return tree_map(cast, args), tree_map(cast, kwargs)

    return cast_inputs


def _cast_outputs_hook(dtype: torch.dtype):
    def cast(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    def cast_outputs(module, args, output):
        return tree_map(cast, output)

    return cast_outputs


def parallelize(
    model: nn.Module,
    zero: int = 3,
    pp: int = 1,
    mixed_precision: MixedPrecision | str | None = None,
    *,
    mesh: Any = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    layout: str | None = None,
    cache_dir: str | None = None,
    planned_world: PlannedWorld | None = None,
    offload: str | None = None,
) -> nn.Module:
    """Shard ``model``'s parameters in place over the data-parallel group; return ``model``.

    ``zero`` is the ZeRO stage (0: replicate and average gradients; 1: shard optimizer state;
    2: + gradients; 3: + parameters). ``pp`` pipeline positions split the world into
    ``world // pp`` data-parallel ranks each (the pipeline split itself is done by the
    compiler). ``mesh``: a ``DeviceMesh`` with dimensions ``("pp", "dp")`` or ``("dp",)``
    (e.g. from ``init_device_mesh``); without one it is built from the default process group.
    ``mixed_precision``: ``None``, ``"bf16"`` or a ``zeroc.MixedPrecision``. ``init_fn(module)``
    initializes a meta-device model's modules (it is also called once on meta tensors first,
    to check that every meta tensor gets written); without it the model's own per-module
    initializer (Hugging Face ``_init_weights``) or ``reset_parameters()`` does. Without an
    initialized process group the world is one rank, unless ``WORLD_SIZE`` > 1 says a launcher
    started several: then it raises ``RuntimeError``. Every rank must call this with the same
    arguments on the same model definition. The result is recorded as
    ``model._zeroc_layout`` (a ``ZeroLayout``); each flat buffer the compiled graphs read
    carries the same ``_zeroc_layout`` and its own ``ParamShard`` as ``_zeroc_param``.
    ``planned_world``: only ``zeroc.world`` passes it (a ``PlannedWorld``: planning on fake
    tensors); kept as ``ZeroLayout.planned`` for the compile path and the executors. On a
    fake process group without it, the planned world is that group's (the user's own script
    run in ``zeroc.world.fake_world``).

    ``layout="auto"`` takes ``zero`` and ``pp`` from the last ``zeroc.tune`` of this model
    structure on this world and device (in ``cache_dir``, default ``~/.cache/zeroc``; one
    written by other torch or zeroc versions, another user's or a corrupt one is refused) and
    makes its compile options the defaults of the model's ``torch.compile`` when the model is
    compiled with inputs of the shapes it was tuned for (options passed there win); the plan
    says where the layout came from and what matched (``zeroc.sharding.tune_cache``). No tuned
    layout raises ``OptionError``.
    """
    tuned: tuple[tuple[str, Any], ...] = ()
    tuned_from, tuned_inputs = "", ()
    if layout is not None:
        zero, pp, tuned, tuned_from, tuned_inputs, offload = tuned_layout(
            model, layout, cache_dir)
    _validate(model, zero)
    check_offload(offload, zero, pp)
    _check_process_group(mesh)
    if planned_world is None and dist.is_initialized() and is_fake_group(dist.group.WORLD):
        # A fake process group (``zeroc.world.fake_world``) is a planned world: the model as
        # the user built it (CPU, or meta with ``init_fn``) plans there, its own
        # initialization run (``skip_init=False``), as on the job's ranks.
        planned_world = PlannedWorld(rank=dist.get_rank(), world_size=dist.get_world_size(),
                                     pp=pp, device=group_device(), skip_init=False)
    shared = planned_world.shared if planned_world is not None else None
    if shared is None or not shared.meta_initializable:
        check_meta_initializable(model, init_fn)
        if shared is not None:  # the positions of one world plan copies of one model
            shared.meta_initializable = True
    policy = mixed_precision_policy(mixed_precision)
    # where the model is made: the planned world's device, else the process group's
    device = planned_world.device if planned_world is not None else group_device()
    skip_init = planned_world is not None and planned_world.skip_init
    mesh_ = build_mesh(pp, mesh, device.type)
    host_mesh = host_dp_mesh(mesh_) if offload is not None else None
    # id(original parameter) -> (the original, kept alive so ids stay unique; its replacement;
    # every (module, local name) owning it; every name it is known by)
    entries: dict[int, tuple[nn.Parameter, ShardedParam, list[tuple[nn.Module, str]],
                             list[str]]] = {}
    modules: dict[nn.Module, list[str]] = {}
    # A meta model in a pipeline keeps no parameter until the split is known.
    deferred = (DeferredInit.capture(model, device, mesh_, init_fn)
                if mesh_.pp > 1 and has_meta_parameters(model) and planned_world is None
                else None)  # planning: fake tensors hold nothing to defer
    for path, module in list(model.named_modules()):
        fresh = materialize_direct(model, module, device, entries, init_fn, skip_init)
        _move_buffers(module, device)
        for local, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in entries:
                # Sharded at once: the full tensor is freed before the next module's. A model
                # built elsewhere (on the CPU, for a CUDA group) moves to the group's device
                # first, as FSDP2's ``fully_shard`` moves it: broadcast and shards live there.
                full = _on_device(fresh.pop(local, param), device)
                if deferred is None or not param.is_meta:
                    full = _broadcast_from_dp_root(full, mesh_, planned_world)
                sharded = _shard(param, full, zero, mesh_, policy, planned_world)
                if offload is not None:
                    offload_rows(sharded, host_mesh)
                if deferred is not None and param.is_meta:
                    deferred.defer(sharded)
                entries[id(param)] = (param, sharded, [], [])
            entries[id(param)][2].append((module, local))
            entries[id(param)][3].append(_join(path, local))
            modules.setdefault(module, []).append(local)
    state = ZeroState(params=[], pp=mesh_.pp)
    for _, sharded, owners, known_as in entries.values():
        sharded.record = dataclasses.replace(
            sharded.record, name=known_as[0], param_name=known_as[0],
            tied_names=tuple(known_as[1:]))
        install(owners, sharded)
        state.params.append(sharded)
    finish_modules(model, modules, state)
    track_requires_grad(model)  # requires_grad changes take effect at the next call
    if offload is not None:
        install_offload_hooks(model)
    if zero == 1:
        ensure_step_hook(after_optimizer_step)
        model.register_load_state_dict_post_hook(refresh_after_load)
    if mesh_.pp > 1:
        from zeroc.sharding.pipeline_clip import register

        register(state)  # torch's clip_grad_norm_ gives the whole pipeline's norm
        ignore_model_logging()
        model.register_forward_pre_hook(mark_batch_dynamic, with_kwargs=True, prepend=True)
        model.register_forward_pre_hook(install_output_capture_hooks, with_kwargs=True)
        install_state_dict_hooks(model, deferred)  # a rank saves only the stages it holds
    install_input_device_check(model, device)
    if policy is not None and policy.param_dtype is not None and policy.cast_forward_inputs:
        model.register_forward_pre_hook(_cast_inputs_hook(policy.param_dtype), with_kwargs=True)
    if policy is not None and policy.output_dtype is not None:
        model.register_forward_hook(_cast_outputs_hook(policy.output_dtype))
    layout = ZeroLayout(
        zero=zero, pp=mesh_.pp, dp=mesh_.dp, world=mesh_.world, mixed_precision=policy,
        mesh=mesh_, params=tuple(s.record for s in state.params), tuned_options=tuned,
        tuned_from=tuned_from, tuned_inputs=tuned_inputs, planned=planned_world,
        offload=offload,
    )
    setattr(model, LAYOUT_ATTR, layout)
    model.__dict__["_zeroc_state"] = state
    # FSDP2's name for the gradient-sync switch, as a method of the parallelized model.
    model.__dict__["set_requires_gradient_sync"] = functools.partial(
        set_requires_gradient_sync, state)
    # The backend finds the layout (pp, mesh) from the flat buffers Dynamo hands it.
    for sharded in state.params:
        setattr(sharded.flat, LAYOUT_ATTR, layout)
        setattr(sharded.flat, PARAM_ATTR, sharded.record)
        setattr(sharded.flat, FLAT_SHARDED_ATTR, sharded)
        setattr(sharded.flat, STATE_ATTR, state)  # a pipelined step reads the sync switch
    return model


def _shard(param: nn.Parameter, full: torch.Tensor, zero: int, mesh: Mesh,
           policy: MixedPrecision | None, planned: PlannedWorld | None) -> ShardedParam:
    """The flat buffer, visible parameter and record that stand for ``param`` on this rank."""
    shape = tuple(param.shape)
    numel = full.numel()
    distributed = mesh.dp_device_mesh is not None
    if zero == 0 or not distributed:
        placement, op_stage = "plain", 0
    elif full.dim() == 0:
        placement, op_stage = "replicate", 0
    else:
        placement, op_stage = "shard", zero
    dp, index = mesh.dp, mesh.dp_index
    # Planning: fake tensors hold no values, so the shard is only its size (a world of 64
    # ranks makes hundreds of them per pipeline position), made without dispatching an op.
    # No rank makes the whole parameter there: ``full`` is a meta tensor (``meta_init``),
    # or, for the dispatched reference (``tests/test_fake_params.py``), a fake made here.
    fake_mode = active_fake_mode() if planned is not None and planned.simulated else None
    if full.is_meta and planned is not None and fake_mode is None:
        full = torch.empty(full.shape, dtype=full.dtype, device=planned.device)
    device = planned.device if full.is_meta and planned is not None else full.device
    if op_stage in (2, 3):
        padded, offset = padded_numel_for(shape, dp), 0
        flat = (fake_flat(fake_mode, padded // dp, full.dtype, device, param.requires_grad)
                if fake_mode is not None else shard_of(full, dp, index))
    else:
        flat = (fake_flat(fake_mode, numel, full.dtype, device, param.requires_grad)
                if fake_mode is not None else full.detach().reshape(-1).clone())
        padded = numel
        offset = index * rows_per_shard(shape, dp) * row_numel(shape) if placement == "shard" else 0
    local_rows = local_rows_for(shape, dp, index) if placement == "shard" else (
        shape[0] if shape else 1)
    record = ParamShard(
        name="", param_name="", tied_names=(), shape=shape,
        dtype=str(full.dtype).removeprefix("torch."), numel=numel, padded_numel=padded,
        shard_numel=flat.numel(), requires_grad=param.requires_grad,
        sharded=placement == "shard", op_stage=op_stage, local_rows=local_rows,
    )
    spec = UnshardSpec(
        shape=shape, numel=numel, group_name=mesh.dp_group_name if distributed else "",
        op_stage=op_stage, param_dtype=policy.param_dtype if policy else None,
        reduce_dtype=policy.reduce_dtype if policy else None,
    )
    if fake_mode is None:
        flat = nn.Parameter(flat, requires_grad=param.requires_grad)
    sharded = ShardedParam(record=record, flat=flat, visible=None, spec=spec,  # type: ignore
                           local_offset=offset, dp_mesh=mesh.dp_device_mesh,
                           placement=placement)
    if fake_mode is not None:
        sharded.visible = fake_visible(fake_mode, sharded)
    else:
        sharded.visible = nn.Parameter(sharded.wrap(sharded.local_view(flat.detach())),
                                       requires_grad=param.requires_grad)
    return sharded
