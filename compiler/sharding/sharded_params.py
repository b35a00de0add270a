"""Sharded parameters: what ``zeroc.parallelize`` puts in a module in place of each parameter.

Every parameter becomes two tensors that share storage:

- its **flat buffer**, a 1-D ``nn.Parameter`` kept outside the module's parameter registry (in
  ``module.__dict__`` as ``_zeroc_flat_<name>``). The compiled graphs and the eager
  ``zeroc::unshard`` op read it, and autograd delivers the gradient to it. Stages 2 and 3: this
  rank's rows, zero-padded to the same size on every rank. Stages 0 and 1 (and 0-d
  parameters): the whole parameter, flattened.
- its **visible parameter**, ``module._parameters[name]``: an ``nn.Parameter`` of the original
  shape whose data is a view of the flat buffer. With a process group and ZeRO 1-3 it holds a
  DTensor on the data-parallel mesh, ``Shard(0)`` (a 0-d parameter: ``Replicate()``); at
  stage 0, or without a process group, a plain tensor. ``model.parameters()``,
  ``state_dict()``, optimizers, DCP and ``clip_grad_norm_`` see only these.

Reading ``module.<name>`` inside the forward of a parallelized module (or while Dynamo traces
one) gives the full weight, gathered from the flat buffer; anywhere else it gives the visible
parameter, so reading a weight never communicates. Modules are given a subclass whose class
attribute ``<name>`` is a property doing exactly that (as ``torch.nn.utils.parametrize`` does).

Gradients: a post-accumulate-grad hook on the flat buffer moves each gradient into the visible
parameter's ``.grad`` (a DTensor over a view of it), adding when one is there, so
``zero_grad``, accumulation and clipping act on the visible parameters as with FSDP2.

Gradient accumulation without synchronisation (``set_requires_gradient_sync(False)``): while
a parameter's "sink" is open, the forward adds that zero-stride leaf of the full shape to
each gathered weight and gathers from a detached buffer, so the backward reduces nothing and
the sink's ``.grad`` sums the full local gradients of every use (the full-size gradient
memory FSDP2's no-sync also holds). The backward that runs with the switch back on reduces
each sum once, bucketed, when it ends, and the sinks close (``zeroc.sharding.accumulation``):
k micro-steps cost one reduction per bucket, issued after the last backward rather than
overlapped inside the graph. The forward is the same graph with the switch on or off, so the
step that ends an accumulation compiles nothing new. A pipeline
(``pp > 1``) never opens sinks, so its graphs are the same with and without sync: the
pipelined step reads the switch when it runs and keeps its own pending sums
(``ZeroState.pipeline_pending``, see ``zeroc.pipeline.pipelined_step``).

ZeRO-1 keeps whole parameters (the forward gathers nothing); the visible DTensor covers this
rank's rows, so the optimizer holds state for those rows only. The backward reduce-scatters
each gradient into the rows of the rank that updates them (``zeroc::reduce_grad`` at stage
1), and ``move_grad`` keeps only those rows (a copy, so the whole-size gradient is freed);
after ``optimizer.step()`` one all-gather per dtype brings every rank's updated rows to all
(``zeroc.sharding.whole_rows``). A step moves a reduce-scatter and an all-gather of the
parameters, DDP's traffic.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from typing import Any, NamedTuple

import torch
from torch import nn

from zeroc.runtime.layout import ParamShard
from zeroc.runtime.torch_compat import make_contiguous_strides_for
from zeroc.runtime.zero_ops import unshard
from zeroc.sharding.accumulation import sink_accumulated
from zeroc.sharding.param_guards import guard_methods

__all__ = ["FLAT_PREFIX", "ShardedParam", "UnshardSpec", "ZeroState", "install",
           "set_requires_gradient_sync"]

FLAT_PREFIX = "_zeroc_flat_"
SPEC_PREFIX = "_zeroc_spec_"
SHARD_PREFIX = "_zeroc_param_"
STATE_ATTR = "_zeroc_state"
SHARDED_ATTR = "_zeroc_sharded"


class UnshardSpec(NamedTuple):
    """The constant arguments of one parameter's ``zeroc::unshard`` call."""

    shape: tuple[int, ...]
    numel: int
    group_name: str
    op_stage: int
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None


@dataclasses.dataclass(eq=False)
class ShardedParam:
    """One parameter's flat buffer, visible parameter and how to map between them."""

    record: ParamShard
    flat: nn.Parameter
    visible: nn.Parameter
    spec: UnshardSpec
    local_offset: int  # first element of this rank's rows inside ``flat``
    dp_mesh: Any  # the DTensor mesh, or None for a plain visible parameter
    placement: str  # "shard", "replicate" or "plain"
    # Gradient accumulation without synchronisation: a zero-stride leaf of the full shape
    # added to the gathered weight, so its ``.grad`` sums the unreduced full gradients.
    sink: torch.Tensor | None = None
    # False once a pipeline gave the parameter to other ranks' stages
    # (``zeroc.sharding.stage_holding``).
    held: bool = True
    # A meta model's ``zeroc.sharding.deferred_init.DeferredInit`` while the values are not
    # computed.
    deferred: Any = None
    # ``move_grad`` is registered on ``flat`` (``zeroc.frontend.model_changes``)
    hooked: bool = False
    # ZeRO-1: ``rows_stamp()`` when the whole parameter last equalled every rank's rows; a
    # write since (a load into the visible rows) makes it stale (``zeroc.sharding.whole_rows``).
    rows_version: tuple[int, int] = (-1, -1)
    # Optimizer offload (``zeroc.sharding.offload``): this rank's rows on the host (the master
    # copy the visible parameter wraps) and the CPU mesh it is placed on; None without.
    host: torch.Tensor | None = None
    host_mesh: Any = None
    # Offload: takes this rank's reduced gradient rows (``offload.stash_grad``) in place of
    # ``move_grad``'s own hand-over.
    take_grad: Any = None

    def open_sink(self, state: ZeroState) -> None:
        """Start accumulating unreduced gradients (``set_requires_gradient_sync(False)``)."""
        if self.sink is None and self.flat.requires_grad:
            dtype = self.spec.reduce_dtype or self.flat.dtype
            zero = torch.zeros((), dtype=dtype, device=self.flat.device)
            self.sink = zero.expand(self.record.shape).requires_grad_()
            owner, model = weakref.ref(self), weakref.ref(state)

            def accumulated(sink: torch.Tensor) -> None:
                sharded, zero_state = owner(), model()
                if sharded is not None and zero_state is not None:
                    sink_accumulated(zero_state, sharded, sink)

            self.sink.register_post_accumulate_grad_hook(accumulated)

    def hook_flat(self) -> None:
        """Register ``move_grad`` as ``flat``'s post-accumulate hook, once.

        The hook holds this object weakly: torch keeps a tensor's hooks where Python's
        collector cannot see them, so a strong reference back to the object that holds the
        tensor would keep the whole model (its flat buffers, residuals) alive forever."""
        if self.hooked:
            return
        owner = weakref.ref(self)

        def move(flat: torch.Tensor) -> None:
            sharded = owner()
            if sharded is not None:
                sharded.move_grad(flat)

        self.flat.register_post_accumulate_grad_hook(move)
        self.hooked = True

    def rows_stamp(self) -> tuple[int, int]:
        """The version counters every in-place write of this rank's rows advances: the flat
        buffer's (writes into a view of it, or into the DTensor's local tensor) and the visible
        parameter's (writes through the DTensor, whose inner ops do not advance the former)."""
        rows = self.host if self.host is not None else self.flat
        return rows._version, self.visible._version

    def local_layout(self) -> tuple[int, tuple[int, ...]]:
        """Where this rank's rows lie in the flat buffer: (first element, their shape)."""
        shape = self.record.shape
        if self.placement != "shard":
            return 0, shape
        return self.local_offset, (self.record.local_rows, *shape[1:])

    def local_view(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``flat`` (or of a tensor laid out like it) in their shape."""
        start, shape = self.local_layout()
        return flat[start : start + math.prod(shape)].view(shape)

    def dtensor_placement(self) -> Any:
        """The visible DTensor's placement on ``dp_mesh`` (``None`` for a plain tensor)."""
        if self.placement == "plain":
            return None
        from torch.distributed.tensor import Replicate, Shard

        return Shard(0) if self.placement == "shard" else Replicate()

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` as the visible parameter's kind of tensor (DTensor or plain)."""
        placement = self.dtensor_placement()
        if placement is None:
            return local
        from torch.distributed.tensor import DTensor

        shape = torch.Size(self.record.shape)
        mesh = self.host_mesh if self.host is not None else self.dp_mesh
        return DTensor.from_local(local, mesh, [placement], run_check=False,
                                  shape=shape, stride=make_contiguous_strides_for(shape))

    def move_grad(self, flat: torch.Tensor) -> None:
        """Post-accumulate hook of ``flat``: its gradient goes to the visible parameter.

        A synchronised step has reduced the accumulation: the sink is dropped."""
        grad = flat.grad
        if grad is None:  # a compiled no-sync step may call the hook with no gradient
            return
        flat.grad = None
        if not self.visible.requires_grad:  # frozen since the graph was traced: none, as eager
            return
        self.sink = None
        rows = self.local_view(grad)
        if self.take_grad is not None:  # offload: to the host, handed over when backward ends
            self.take_grad(self, rows)
            return
        if self.record.op_stage == 1:  # ZeRO-1: keep the rows, free the whole-size gradient
            rows = rows.clone()
        incoming = self.wrap(rows)
        if self.visible.grad is None:
            self.visible.grad = incoming
        else:
            self.visible.grad.add_(incoming)


@dataclasses.dataclass(eq=False)
class ZeroState:
    """Mutable per-model state: every sharded parameter and the gradient-sync switch."""

    params: list[ShardedParam]
    requires_gradient_sync: bool = True
    # Pipeline positions (``parallelize``'s pp). With pp > 1 no sink is opened.
    pp: int = 1
    # pp > 1: unsynchronised gradients of pipelined steps, by ``id`` of the flat buffer (the
    # graph input), summed and already scaled by each step's seeded gradient; and whether a
    # pipelined step ran without sync since the last synchronised one (the same on every rank,
    # as every rank runs the same loop: the next synchronised step then reduces in its
    # backward, where the seeded gradient is known). See ``zeroc.pipeline.pipelined_step``.
    pipeline_pending: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    pipeline_accumulating: bool = False
    # pp == 1: parameters whose accumulated sums the backward that ends an accumulation
    # reduces when it ends (``zeroc.sharding.accumulation``).
    flushing: list[ShardedParam] = dataclasses.field(default_factory=list)


class _ForwardDepth(threading.local):
    depth = 0


_FORWARD = _ForwardDepth()


def _enter_forward(module: nn.Module, args: Any) -> None:
    if not torch.compiler.is_compiling():
        _FORWARD.depth += 1


def _exit_forward(module: nn.Module, args: Any, output: Any) -> None:
    if not torch.compiler.is_compiling():
        _FORWARD.depth = max(0, _FORWARD.depth - 1)


# The hooks above, for code that traces a parallelized model without them (they do nothing
# while compiling): ``zeroc.world.plan_capture``.
FORWARD_DEPTH_HOOKS = (_enter_forward, _exit_forward)


# Each distinct spec by its text. A module holds the text of its parameters' specs, so
# Dynamo guards one string per parameter (and a reused block region re-checks one) instead
# of each field of the spec; the text names every field, so equal texts are equal specs.
_SPECS: dict[str, UnshardSpec] = {}


def _spec_key(spec: UnshardSpec) -> str:
    """``spec``'s text, under which ``_spec_of`` finds it."""
    key = repr(spec)
    _SPECS.setdefault(key, spec)
    return key


@torch.compiler.assume_constant_result
def _spec_of(key: str) -> UnshardSpec:
    """The spec whose text is ``key`` (a constant to Dynamo: ``key`` is guarded instead)."""
    return _SPECS[key]


def full_weight(module: nn.Module, name: str) -> torch.Tensor:
    """``module.<name>`` gathered in full from its flat buffer (differentiable).

    While an accumulation is open (the parameter's sink), the gradient goes, unreduced, to
    the sink, whose hook reduces the sum once the switch is on again (see above)."""
    spec = _spec_of(module.__dict__[SPEC_PREFIX + name])
    flat = module.__dict__[FLAT_PREFIX + name]
    sink = module.__dict__[SHARD_PREFIX + name].sink
    if sink is not None:
        gathered = unshard(flat.detach(), spec.shape, spec.numel, spec.group_name,
                           spec.op_stage, spec.param_dtype)
        return gathered + sink.to(gathered.dtype)
    return unshard(flat, spec.shape, spec.numel, spec.group_name, spec.op_stage,
                   spec.param_dtype, spec.reduce_dtype)


def _property(name: str) -> property:
    def get(self: nn.Module) -> torch.Tensor:
        if torch.compiler.is_compiling() or _FORWARD.depth > 0:
            return full_weight(self, name)
        return self._parameters[name]

    def set_(self: nn.Module, value: Any) -> None:
        raise AttributeError(
            f"cannot assign {type(self).__name__}.{name}: the module was parallelized by "
            "zeroc; change the parameter in place (with torch.no_grad(): "
            f"module.{name}.copy_(...)) or load a state dict"
        )

    return property(get, set_, doc=f"``{name}``: gathered in the forward, else the shard.")


_SUBCLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


class _SaveSettings(threading.local):
    include_released = False  # True inside ``zeroc.sharding.stage_holding.all_parameters``


SAVE_SETTINGS = _SaveSettings()


def _saver(cls: type, names: tuple[str, ...]):
    """``_save_to_state_dict`` that leaves out parameters released to other pipeline ranks
    (``zeroc.sharding.stage_holding``): the ranks holding them save them.

    A ZeRO-1 parameter is saved as a DTensor over the flat buffer's rows that shares the
    buffer's version counter (the visible parameter's ``detach()`` would not), so an in-place
    load into the state dict (DCP's ``dcp.load``) is seen: ``zeroc.sharding.whole_rows``; an
    offloaded one as a DTensor over its host rows, likewise (``zeroc.sharding.offload``)."""
    def save(self: nn.Module, destination: dict, prefix: str, keep_vars: bool) -> None:
        shards = {n: self.__dict__[SHARD_PREFIX + n] for n in names}
        released = {n for n, sharded in shards.items() if not sharded.held}
        params = self.__dict__["_parameters"]
        if released and not SAVE_SETTINGS.include_released:
            self.__dict__["_parameters"] = {k: v for k, v in params.items() if k not in released}
        try:
            cls._save_to_state_dict(self, destination, prefix, keep_vars)
        finally:
            self.__dict__["_parameters"] = params
        for name, sharded in shards.items():
            if keep_vars or prefix + name not in destination:
                continue
            if sharded.host is not None:
                destination[prefix + name] = sharded.wrap(sharded.host.detach())
            elif sharded.record.op_stage == 1 and sharded.placement == "shard":
                destination[prefix + name] = sharded.wrap(sharded.local_view(sharded.flat.detach()))

    return save


def _qualified_name(module: nn.Module, name: str) -> str:
    return module.__dict__[SHARD_PREFIX + name].record.name


def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    key = (cls, names)
    if key not in _SUBCLASSES:
        attrs = {n: _property(n) for n in names}
        attrs["_save_to_state_dict"] = _saver(cls, names)
        attrs.update(guard_methods(cls, names, _qualified_name))  # replacing one raises
        attrs["__module__"] = cls.__module__
        _SUBCLASSES[key] = type(cls.__name__, (cls,), attrs)
    return _SUBCLASSES[key]


def install(owners: list[tuple[nn.Module, str]], sharded: ShardedParam) -> None:
    """Put ``sharded`` into every ``(module, local name)`` that owned the parameter."""
    for module, local in owners:
        module._parameters[local] = sharded.visible
        module.__dict__[FLAT_PREFIX + local] = sharded.flat
        module.__dict__[SPEC_PREFIX + local] = _spec_key(sharded.spec)
        module.__dict__[SHARD_PREFIX + local] = sharded
    setattr(sharded.visible, SHARDED_ATTR, sharded)
    sharded.rows_version = sharded.rows_stamp()
    # A frozen parameter gets no gradient (one unfrozen later: ``zeroc.frontend.model_changes``).
    if sharded.flat.requires_grad:
        sharded.hook_flat()


def finish_modules(root: nn.Module, modules: dict[nn.Module, list[str]],
                   state: ZeroState) -> None:
    """Swap each owner's class for its property subclass and count forward depth."""
    for module, names in modules.items():
        module.__class__ = _sharded_class(type(module), tuple(dict.fromkeys(names)))
        module.__dict__[STATE_ATTR] = state
    for module in {root, *modules}:
        module.register_forward_pre_hook(_enter_forward)
        module.register_forward_hook(_exit_forward, always_call=True)


def state_of(model: nn.Module) -> ZeroState | None:
    """The ``ZeroState`` of a parallelized model (``None`` if it was not parallelized)."""
    state = model.__dict__.get(STATE_ATTR)
    if state is None:
        state = next((m.__dict__[STATE_ATTR] for m in model.modules()
                      if STATE_ATTR in m.__dict__), None)
    return state


def set_requires_gradient_sync(state: ZeroState, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction off (accumulate locally) or back on (the next backward reduces
    this step's and every accumulated gradient)."""
    state.requires_gradient_sync = bool(requires_gradient_sync)
    # A pipeline runs its backward inside the compiled call: it reads the switch at run time
    # (``zeroc.pipeline.pipelined_step``) and its graphs must not depend on it.
    if not requires_gradient_sync and state.pp == 1:
        for sharded in state.params:
            sharded.open_sink(state)


_STEP_HOOKS: dict[Any, Any] = {}


def ensure_step_hook(hook: Any) -> None:
    """Register ``hook`` as a global optimizer-step post-hook, once per process (ZeRO-1's
    row gather, optimizer offload's copy to the device)."""
    if hook not in _STEP_HOOKS:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _STEP_HOOKS[hook] = register_optimizer_step_post_hook(hook)


def sharded_of(param: torch.Tensor) -> ShardedParam | None:
    """The ``ShardedParam`` behind a visible parameter, if it is one."""
    return getattr(param, SHARDED_ATTR, None)
