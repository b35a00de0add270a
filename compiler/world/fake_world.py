"""Plan a job for a world that is not there: zeroc's real program on fake tensors.

``plan_world(model, example_inputs, world=W, pp=P, zero=S, device="cuda")`` runs, in this
process, what every rank of a W-rank job would run: ``zeroc.parallelize``, Dynamo capture,
the passes, the stage split and schedule, and one training step (forward, backward, AdamW)
through the real executors, on ``FakeTensorMode`` tensors (shapes, dtypes and devices, no
data; any device mix raises) with a fake process group (``"fake"`` backend: every collective
and p2p call is made, none moves data). Planned for ``device="cuda"``, it holds NCCL's rules:
every collective's tensors must be on the rank's GPU (``zeroc.runtime.nccl_devices``, a CPU
tensor raises naming the call site), and the pipeline's transfers must be matchable in the
order each rank issued them (``zeroc.runtime.nccl_order``, checked by ``world_plan``).

Ranks that run the same program are planned once: the ranks of one pipeline position differ
only in which rows of each parameter they hold, so one representative per position (its
first data-parallel rank) is planned, ``P`` programs in all. Each rank's parameters,
gradients and optimizer state are read from its fake tensors after the step, and its peak is
measured during the step by ``zeroc.runtime.step_memory.StepMemory``, the same tracker a real
run uses.

The model may be on the meta device (nothing is ever allocated: fake tensors hold no memory)
or on the CPU (it is copied to meta first; the user's model is not touched). Values never
exist, so nothing here can depend on them: a model whose forward reads a tensor's value
(``.item()``, data-dependent control flow) is refused, naming the op.

A planned rank is not a rank of this process: ``init_process_group`` wraps ``sys.excepthook``
so that an uncaught traceback prints behind ``[rank<r>]:``, and one wrap per planned position
would nest a prefix per position (``[rank56]: [rank0]: [rank48]: ...``), none of them the
failing one's. ``fake_world`` puts the process's own hook back, so a traceback carries at most
the prefix of this process's own rank; an error raised while a rank is planned names that
rank in a note instead (``plan_position``). Log lines inside a fake world carry torch's one
``[rank<r>]:`` (the planned rank) under ``TORCH_LOGS``, as a real rank's do.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroc.runtime import nccl_order
from zeroc.runtime.nccl_devices import strict_devices
from zeroc.runtime.nccl_order import P2PRecord
from zeroc.runtime.torch_compat import FakeTensorMode
from zeroc.runtime.world import PlannedWorld, SharedPlanning
from zeroc.sharding.meta_init import COPY_OF_VALUES_ATTR
from zeroc.world.fake_cuda import ensure_fake_cuda, fake_cuda_planning, run_backward
from zeroc.world.plan_capture import SharedTrace

__all__ = ["PositionPlan", "fake_world", "loss_of", "meta_copy", "plan_position",
           "share_front"]

log = logging.getLogger(__name__)

DEVICES = ("cuda", "cpu")


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are meta tensors (ties kept).

    The copy of a model that holds values (built on the CPU or a device) is marked so: planning
    it asks for no initializer, since the user's model needs none."""
    memo: dict[int, Any] = {}
    tensors = [*model.parameters(), *model.buffers()]
    for tensor in tensors:
        if id(tensor) in memo:
            continue
        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        memo[id(tensor)] = (nn.Parameter(empty, tensor.requires_grad)
                            if isinstance(tensor, nn.Parameter) else empty)
    replica = copy.deepcopy(model, memo)
    if not any(t.is_meta for t in tensors):
        replica.__dict__[COPY_OF_VALUES_ATTR] = True
    return replica


@contextlib.contextmanager
def fake_world(rank: int, world: int, pp: int, device: str) -> Iterator[FakeTensorMode]:
    """A fake process group as ``rank`` of ``world``, its (pp, dp) mesh, and a fake tensor
    mode on ``device``."""
    from zeroc.runtime.torch_compat import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "zeroc.explain(world=...) plans with a fake process group in this process, but a "
            "process group is already initialized: call it before init_process_group, or in "
            "a separate process (python -m zeroc explain ...)")
    if device == "cuda":
        ensure_fake_cuda()
    # The fake backend for the devices the planned job's group serves, as torch configures a
    # real one ("cpu:gloo,cuda:nccl"): group_device() reads the planned device from it.
    backend = "cpu:fake,cuda:fake" if device == "cuda" else "cpu:fake"
    hook = sys.excepthook  # torch wraps it with this planned rank's prefix (module docstring)
    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world)
    sys.excepthook = hook
    from zeroc.runtime.mesh import build_mesh

    build_mesh(pp, None, device)  # on real tensors (it reads its rank table); parallelize reuses it
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    torch.compiler.reset()
    try:
        with contextlib.ExitStack() as stack:
            if device == "cuda":  # NCCL's rules: CUDA fake tensors, and collectives on them
                stack.enter_context(fake_cuda_planning())
            stack.enter_context(mode)
            if device == "cuda":
                stack.enter_context(strict_devices(planned_device(device)))
            yield mode
    finally:
        torch.compiler.reset()
        from zeroc.runtime import shutdown

        shutdown.release_destroyed_groups()
        dist.destroy_process_group()


def planned_device(device: str) -> torch.device:
    """The device a planned world on ``device`` (``"cuda"`` or ``"cpu"``) allocates on."""
    return torch.device(device, 0) if device == "cuda" else torch.device(device)


def planned_world(rank: int, world: int, pp: int, device: str,
                  shared: SharedPlanning | None = None) -> PlannedWorld:
    """The ``PlannedWorld`` of rank ``rank`` planned in ``fake_world``: what
    ``zeroc.parallelize(..., planned_world=)`` is given. ``shared``: the holder of the world
    being planned (``zeroc.world.world_plan``), or None for one rank planned alone."""
    return PlannedWorld(rank=rank, world_size=world, pp=pp, device=planned_device(device),
                        shared=shared)


def _fake_inputs(example_inputs: Any, device: torch.device) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of fake tensors on ``device`` standing for ``example_inputs``."""
    def fake(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.empty(value.shape, dtype=value.dtype, device=device)
        return value

    if isinstance(example_inputs, dict):
        return (), {k: fake(v) for k, v in example_inputs.items()}
    if isinstance(example_inputs, torch.Tensor):
        return (fake(example_inputs),), {}
    return tuple(fake(v) for v in example_inputs), {}


def loss_of(output: Any, caller: str = "zeroc.explain(world=...)") -> torch.Tensor:
    """The scalar loss in a model's ``output`` (a tensor, or ``.loss`` / ``["loss"]``);
    ``caller`` names who needs it in the error."""
    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"{caller}: the model returned {type(output).__name__}; a training step needs a "
            "scalar loss (return it, or a Hugging Face output with .loss: pass labels= in "
            "example_inputs)")
    return loss


@dataclasses.dataclass(frozen=True)
class PositionPlan:
    """What one representative rank of a pipeline position measured in its fake step."""

    rank: int
    plan: Any
    memory: dict[str, int]
    seconds: float
    # The point-to-point transfers its step issued, in order (``zeroc.runtime.nccl_order``).
    p2p: P2PRecord | None = None


def _storage_bytes(tensors: list[Any], device_type: str | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor: its local shard; a
    parameter another pipeline rank holds: nothing); only those on ``device_type`` if given."""
    seen, total = set(), 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        local = getattr(tensor, "_local_tensor", tensor)
        if local.is_meta or (device_type is not None and local.device.type != device_type):
            continue
        storage = local.untyped_storage()
        if id(storage) not in seen:
            seen.add(id(storage))
            total += storage.nbytes()
    return total


def _held(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[Any]]:
    state = model.__dict__.get("_zeroc_state")
    flats = [s.flat for s in state.params] if state is not None else list(model.parameters())
    return {"params": flats, "grads": [p.grad for p in model.parameters()],
            "optimizer": [v for st in optimizer.state.values() for v in st.values()
                          if getattr(v, "dim", lambda: 0)()]}


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer,
               device_type: str | None = None) -> dict[str, int]:
    """Parameters, gradients and optimizer state this rank holds, from the tensors (only on
    ``device_type`` if given)."""
    return {kind: _storage_bytes(tensors, device_type)
            for kind, tensors in _held(model, optimizer).items()}


def _offloaded(model: nn.Module) -> bool:
    state = model.__dict__.get("_zeroc_state")
    return state is not None and any(s.host is not None for s in state.params)


def measured_step(compiled: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
                  args: tuple, kwargs: dict, backward: Any) -> dict[str, int]:
    """One training step measured by ``StepMemory``: at rest (after it, before
    ``zero_grad``) and the peak of a step in the steady state, every step after the first:
    parameters at rest + the most of (the optimizer state after the step + the most bytes
    alive during the forward and backward; the optimizer state it started with + the most
    bytes alive during the whole step, the optimizer's own step included, which makes the
    state on a first step). Parameters at rest are those held after the step: a step that
    compiles releases, as it compiles, the parameters other pipeline positions hold, which
    the rank never holds while it trains."""
    from zeroc.runtime.step_memory import StepMemory

    optimizer.zero_grad(set_to_none=True)
    # Optimizer offload: the device's bytes only; the host's are reported apart.
    device_type = next((s.flat.device.type for s in model._zeroc_state.params), None) if (
        _offloaded(model)) else None
    before = held_bytes(model, optimizer, device_type)
    tracker = StepMemory(device_type)
    tracker.held(t for tensors in _held(model, optimizer).values() for t in tensors)
    with tracker.active():
        loss = loss_of(compiled(*args, **kwargs))
        backward(loss)
        del loss
        forward_backward = tracker.peak
        with tracker:
            optimizer.step()
    after = held_bytes(model, optimizer, device_type)
    host = 0
    if device_type is not None and device_type != "cpu":
        everything = held_bytes(model, optimizer)
        host = sum(everything.values()) - sum(after.values()) + sum(
            s.host.untyped_storage().nbytes() for s in model._zeroc_state.params
            if s.host is not None and s.host.device.type == "cpu")
    return {**after, "host": host,
            "peak": after["params"] + max(after["optimizer"] + forward_backward,
                                          before["optimizer"] + tracker.peak)}


def _backward_for(device: str) -> Any:
    """The step's backward: the autograd engine wherever it accepts the fake tensors (CPU
    ones; CUDA ones where a GPU is present, or on a CPU-only torch inside
    ``fake_cuda_planning``), so the backward frees what a real one frees when a real one
    frees it; else (fake CUDA tensors on a CUDA build without a GPU) ``run_backward``'s walk,
    whose peak is higher: a gradient it hands to a parameter is still referenced, so
    ``AccumulateGrad`` copies it where the engine would take it over."""
    if device == "cpu" or torch.cuda.is_available() or not torch.backends.cuda.is_built():
        return lambda loss: loss.backward()
    return run_backward


def _explain_value_read(error: Exception) -> None:
    """Raise a ``ValueError`` naming the op when ``error`` is a value read on a fake tensor."""
    if isinstance(error, ValueError) and str(error).startswith("zeroc"):
        return  # zeroc's own diagnosis (a graph break names "data-dependent" as one cause)
    text = f"{type(error).__name__}: {error}"
    if "DataDependent" in text or "data-dependent" in text.lower():
        op = next((w for w in text.replace(",", " ").split() if w.startswith("aten.")), "")
        raise ValueError(
            "zeroc.explain(world=...): the model reads a tensor's value "
            f"{'(' + op + ') ' if op else ''}while it runs; planning uses fake tensors, which "
            "have no values: remove the .item() / data-dependent branch, or plan with a real "
            "run (zeroc.explain(compiled) after a step)") from None


def plan_position(model: nn.Module, example_inputs: Any, *, rank: int, world: int, pp: int,
                  zero: int, device: str, options: dict | None,
                  mixed_precision: Any = None, trace: SharedTrace | None = None,
                  shared: SharedPlanning | None = None,
                  offload: str | None = None) -> PositionPlan:
    """Plan global rank ``rank`` of a ``world``-rank job: one fake training step.

    ``trace``: with ``pp > 1``, Dynamo's graph shared by the positions of one world
    (``zeroc.world.plan_capture``): taken here if it is empty, compiled here if it can be reused.
    An error raised here names the planned rank in a note (the module docstring says why)."""
    started = time.perf_counter()
    replica = meta_copy(model)
    planned = planned_world(rank, world, pp, device, shared)
    try:
        plan, memory, p2p = _planned_step(replica, example_inputs, planned, device,
                                          zero=zero, options=options,
                                          mixed_precision=mixed_precision, trace=trace,
                                          offload=offload)
    except Exception as error:
        error.add_note(f"zeroc: raised while planning rank {rank} of {world} (pp={pp})")
        raise
    seconds = time.perf_counter() - started
    log.info("planned rank %d of %d (pp=%d) in %.1f s", rank, world, pp, seconds)
    return PositionPlan(rank=rank, plan=plan, memory=memory, seconds=seconds, p2p=p2p)


def _planned_step(replica: nn.Module, example_inputs: Any, planned: PlannedWorld,
                  device: str, *, zero: int, options: dict | None,
                  mixed_precision: Any, trace: SharedTrace | None,
                  offload: str | None) -> tuple[Any, dict[str, int], P2PRecord | None]:
    """``plan_position``'s fake world and step: (the plan, the memory row, the transfers)."""
    import zeroc
    from zeroc.frontend.session_plan import build_plan

    rank, world, pp = planned.rank, planned.world_size, planned.pp
    with fake_world(rank, world, pp, device) as _:
        args, kwargs = _fake_inputs(example_inputs, planned.device)
        parallel = zeroc.parallelize(replica, zero=zero, pp=pp, mixed_precision=mixed_precision,
                                     planned_world=planned, offload=offload)
        optimizer = torch.optim.AdamW(parallel.parameters())
        session = None
        try:  # compiled outside the tracker: its module hooks would split Dynamo's graph
            if trace is not None and pp > 1 and not trace.attempted:
                trace.trace(parallel, args, kwargs)
            if trace is not None and trace.reusable:
                compiled, session = trace.compile(parallel, args, kwargs, options)
            else:
                compiled = torch.compile(parallel, backend="zeroc", options=dict(options or {}))
            # One step, measured. A graph that runs for the first time on its input shapes is
            # recorded and replayed by later steps (fake_replay), which gives the same figures:
            # the first step's are a later step's.
            with nccl_order.recording() as p2p:
                memory = measured_step(compiled, parallel, optimizer, args, kwargs,
                                       _backward_for(device))
        except Exception as error:
            _explain_value_read(error)
            raise
        plan = zeroc.explain(compiled) if session is None else build_plan(session)
    return plan, memory, p2p


def share_front(model: nn.Module, example_inputs: Any, *, world: int, pp: int, zero: int,
                device: str, options: dict | None, mixed_precision: Any,
                trace: SharedTrace, shared: SharedPlanning | None = None) -> None:
    """Before any position of a ``pp > 1`` world is planned: trace the model once, as rank 0,
    into ``trace`` and, when the trace can be shared, build the pipeline front every position
    compiles from (kept in ``shared``, the world's ``SharedPlanning``), so that the positions,
    planned in two processes (``zeroc.world.plan_workers``), inherit both. A model the shared
    trace cannot take is left to each position's own compile, which reports what is wrong as a
    user's would."""
    import zeroc

    started = time.perf_counter()
    replica = meta_copy(model)
    planned = planned_world(0, world, pp, device, shared)
    with fake_world(0, world, pp, device):
        args, kwargs = _fake_inputs(example_inputs, planned.device)
        parallel = zeroc.parallelize(replica, zero=zero, pp=pp, mixed_precision=mixed_precision,
                                     planned_world=planned)
        try:
            trace.trace(parallel, args, kwargs)
            if trace.reusable:
                trace.build_front(parallel, args, kwargs, options)
        except Exception as error:
            _explain_value_read(error)
            raise
    log.info("traced the model and built the positions' shared front in %.1f s",
             time.perf_counter() - started)
