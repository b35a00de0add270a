"""Optimizer offload: ``zeroc.parallelize(model, zero=2 or 3, offload="optimizer")``.

The optimizer state and the float32 master rows live in host memory (pinned on CUDA); the
device keeps only what the compiled graphs read, each parameter's flat shard. Per parameter:

- ``ShardedParam.host``: this rank's rows on the host, the master copy. The visible parameter
  (what ``model.parameters()`` gives the optimizer, ``clip_grad_norm_`` and DCP) is a DTensor
  over it on a CPU mesh of the data-parallel ranks (``runtime.mesh.host_dp_mesh``: a gloo
  group beside an NCCL one), so the optimizer creates its state on the host and DTensor
  collectives on host tensors never reach NCCL.
- backward: as each gradient's reduction completes in the graph, the post-accumulate hook
  copies this rank's reduced rows to the host (``stash_grad``: asynchronous from the device
  into pinned memory on CUDA); one callback at the end of the backward waits for the copies
  (one host synchronization per backward on CUDA, none on the CPU) and hands them to the
  visible parameters' ``.grad`` (adding when one is there).
- ``optimizer.step()`` runs on the host (torch's CPU AdamW, ``foreach``); a global step
  post-hook (``after_optimizer_step``) copies the updated rows into the device shards, on a
  side stream on CUDA, and makes the compute stream wait for that stream there: the host
  goes on at once, and whatever the compute stream runs next (the next forward, however the
  model is called) reads the new rows.
- a load (``load_state_dict``, DCP's ``set_model_state_dict`` or its in-place ``dcp.load``)
  writes the host rows; the forward pre-hook copies what changed to the device
  (``refresh_stale``, by version counters as ``zeroc.sharding.whole_rows`` does).

On the CPU the host is the device: the same copies run, so the numbers equal a run without
offload exactly. Supported: ZeRO-2 and ZeRO-3 at pp=1.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from zeroc.runtime.torch_compat import FakeTensor
from zeroc.sharding.sharded_params import ShardedParam, ensure_step_hook, sharded_of

__all__ = ["OFFLOADS", "after_optimizer_step", "check_offload",
           "install_hooks", "make_host_rows", "offload_rows",
           "refresh_stale", "stash_grad"]

log = logging.getLogger(__name__)

OFFLOADS = (None, "optimizer")


def check_offload(offload: str | None, zero: int, pp: int) -> None:
    """Refuse an ``offload`` that is not supported, naming what is."""
    if offload not in OFFLOADS:
        raise ValueError(f"zeroc.parallelize: offload={offload!r} is not allowed; allowed: "
                         f"{list(OFFLOADS)}")
    if offload is None:
        return
    if zero not in (2, 3):
        raise ValueError(f"zeroc.parallelize: offload={offload!r} keeps each rank's shard of "
                         f"the optimizer state and gradients on the host, which needs zero=2 "
                         f"or zero=3; got zero={zero}")
    if pp != 1:
        raise ValueError(f"zeroc.parallelize: offload={offload!r} is supported at pp=1 only "
                         f"(ZeRO-2/3 data parallelism); got pp={pp}")


def make_host_rows(rows: torch.Tensor) -> torch.Tensor:
    """A host copy of a device shard's rows: pinned when they are on CUDA (a planned world's
    fake tensors stand for pinned memory unpinned: they hold no bytes)."""
    host = rows.detach().to("cpu", copy=True)
    return host.pin_memory() if rows.is_cuda and not isinstance(rows, FakeTensor) else host


def offload_rows(sharded: ShardedParam, host_mesh: Any) -> None:
    """Give ``sharded`` its host rows and make its visible parameter a DTensor over them on
    ``host_mesh`` (a plain tensor without a data-parallel group)."""
    sharded.host = make_host_rows(sharded.local_view(sharded.flat.detach()))
    sharded.host_mesh = host_mesh
    sharded.take_grad = stash_grad
    if sharded.dtensor_placement() is not None and host_mesh is None:
        raise AssertionError("an offloaded DTensor parameter needs a host mesh")
    sharded.visible = torch.nn.Parameter(sharded.wrap(sharded.host),
                                         requires_grad=sharded.visible.requires_grad)


def install_hooks(model: torch.nn.Module) -> None:
    """The step post-hook (updated rows to the device), a load post-hook and a forward
    pre-hook (rows loaded on the host to the device; the forward waits for the copies)."""
    from zeroc.sharding.sharded_params import state_of

    ensure_step_hook(after_optimizer_step)

    def after_load(module: torch.nn.Module, incompatible: Any) -> None:
        state = state_of(module)
        if state is not None:
            refresh_stale(state.params, "a state dict was loaded")

    model.register_load_state_dict_post_hook(after_load)


class _Pending:
    """Gradients copied to the host in this backward, handed over when it ends."""

    def __init__(self) -> None:
        self.grads: list[tuple[ShardedParam, torch.Tensor]] = []
        self.event: Any = None
        self.queued = False


_PENDING = _Pending()
_SIDE_STREAMS: dict[Any, Any] = {}


def _streams(tensor: torch.Tensor) -> bool:
    """Whether copies of ``tensor`` run asynchronously on CUDA streams (a real CUDA tensor;
    a planned world's fake CUDA tensors are copied as on the CPU)."""
    return tensor.is_cuda and torch.cuda.is_available()


def stash_grad(sharded: ShardedParam, rows: torch.Tensor) -> None:
    """Post-accumulate hook body for an offloaded parameter: copy its reduced rows to the
    host now; ``_finish_backward`` gives them to the visible parameter."""
    if _streams(rows):
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        _PENDING.event = torch.cuda.Event()
        _PENDING.event.record()
    else:  # the CPU, or a planned world's fake CUDA tensors
        host = rows.detach().to("cpu", copy=True)
    _PENDING.grads.append((sharded, host))
    if not _PENDING.queued:
        _PENDING.queued = True
        torch.autograd.Variable._execution_engine.queue_callback(_finish_backward)


def _finish_backward() -> None:
    """End of a backward: wait for the gradient copies, then set or add each ``.grad``."""
    if _PENDING.event is not None:
        _PENDING.event.synchronize()  # the one host wait of an offloaded backward on CUDA
    grads, _PENDING.grads, _PENDING.event, _PENDING.queued = _PENDING.grads, [], None, False
    for sharded, host in grads:
        incoming = sharded.wrap(host)
        if sharded.visible.grad is None:
            sharded.visible.grad = incoming
        else:
            sharded.visible.grad.add_(incoming)


def _push(params: Iterable[ShardedParam]) -> int:
    """Copy the host rows of ``params`` into their device shards; record them as fresh."""
    pushed = 0
    stream = None
    for sharded in params:
        device_rows = sharded.local_view(sharded.flat.detach())
        if _streams(device_rows):
            if stream is None:
                stream = _SIDE_STREAMS.setdefault(device_rows.device,
                                                  torch.cuda.Stream(device_rows.device))
                stream.wait_stream(torch.cuda.current_stream(device_rows.device))
            with torch.cuda.stream(stream), torch.no_grad():
                device_rows.copy_(sharded.host, non_blocking=True)
        else:
            with torch.no_grad():
                device_rows.copy_(sharded.host)
        sharded.rows_version = sharded.rows_stamp()
        pushed += 1
    if stream is not None:  # the compute stream's next work reads the copied rows
        torch.cuda.current_stream(stream.device).wait_stream(stream)
    return pushed


def after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step post-hook: the updated host rows go to the device shards."""
    stepped = (sharded_of(p) for group in optimizer.param_groups for p in group["params"])
    _push(dict.fromkeys(s for s in stepped if s is not None and s.host is not None))


def refresh_stale(params: Iterable[ShardedParam], why: str) -> int:
    """Copy to the device the host rows written since their last copy (a load); how many."""
    stale = [s for s in params if s.host is not None and s.rows_stamp() != s.rows_version]
    if stale:
        log.info("zeroc: offload: %d parameter(s) written on the host (%s): copied to the "
                 "device", len(stale), why)
        _push(stale)
    return len(stale)

