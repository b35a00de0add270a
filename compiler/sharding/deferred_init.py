"""Meta-device models in a pipeline: a rank initializes only the parameters its stages hold.

With ``pp > 1`` the split is only known when the pipeline compiles, so ``zeroc.parallelize``
does not keep a meta model's parameters: it still runs the per-module initialization (the
modules' buffers become real, and the random stream advances as it would), but every parameter
is *deferred*: its flat buffer has its final size and no storage, its visible parameter a
``meta`` local tensor (``zeroc.sharding.stage_holding``). ``DeferredInit`` keeps what is needed to
compute the same values again later:

- a ``meta`` deep copy of the model taken before anything was materialized (no memory);
- the random generator state of global rank 0 at that moment, broadcast to every rank, so
  every rank computes the very values rank 0 would, with no further communication (data-
  parallel replicas and tied parameters across stages agree by construction).

``materialize(wanted)`` replays the initialization on the copy, module by module under that
random state (one module's full tensors alive at a time), and writes this rank's rows of the
wanted parameters into their flat buffers; the others are dropped as they are made. The
pipeline calls it with its stages' parameters; ``state_dict()`` or ``load_state_dict()``
before the first compiled step calls it with every parameter (logged), because a checkpoint
must see real tensors.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from zeroc.runtime.mesh import Mesh
from zeroc.runtime.step_memory import note_resized
from zeroc.runtime.zero_ops import shard_of
from zeroc.sharding.meta_init import materialize_direct
from zeroc.sharding.sharded_params import SHARD_PREFIX, ShardedParam
from zeroc.sharding.stage_holding import release

__all__ = ["DeferredInit", "has_meta_parameters"]

log = logging.getLogger(__name__)

_PLAN_ATTR = "_zeroc_meta_init"  # zeroc.sharding.meta_init's plan: rebuilt for the copy


def has_meta_parameters(model: nn.Module) -> bool:
    """True when any parameter of ``model`` is on the meta device."""
    return any(p.is_meta for p in model.parameters())


def _rng_state(device: torch.device) -> list[torch.Tensor]:
    states = [torch.random.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _rank0_rng_state(device: torch.device) -> list[torch.Tensor]:
    """This process's generator states, replaced by global rank 0's."""
    states = _rng_state(device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        shared = [states]
        dist.broadcast_object_list(shared, src=0)
        states = [s.cpu() for s in shared[0]]
    return states


@dataclasses.dataclass(eq=False)
class DeferredInit:
    """How to compute a meta model's initial parameters again (see the module docstring)."""

    pristine: nn.Module
    model: nn.Module
    device: torch.device
    mesh: Mesh
    init_fn: Callable[[nn.Module], None] | None
    rng: list[torch.Tensor]
    pending: dict[int, ShardedParam] = dataclasses.field(default_factory=dict)  # by id

    @classmethod
    def capture(cls, model: nn.Module, device: torch.device, mesh: Mesh,
                init_fn: Callable[[nn.Module], None] | None) -> DeferredInit:
        """Call before ``model`` is materialized."""
        pristine = copy.deepcopy(model)
        pristine.__dict__.pop(_PLAN_ATTR, None)
        return cls(pristine=pristine, model=model, device=device, mesh=mesh, init_fn=init_fn,
                   rng=_rank0_rng_state(device))

    def defer(self, sharded: ShardedParam) -> None:
        """Drop ``sharded``'s values until ``materialize`` computes them again."""
        release(sharded)
        sharded.deferred = self
        self.pending[id(sharded)] = sharded

    def forget(self, sharded: ShardedParam) -> None:
        """``sharded`` belongs to other ranks' stages: it is never initialized here."""
        self.pending.pop(id(sharded), None)
        sharded.deferred = None

    def materialize_all(self, reason: str) -> None:
        """Initialize every pending parameter (``reason``: why, for the log)."""
        if self.pending:
            log.warning("%s before the pipeline compiled: initializing all %d parameters on "
                        "this rank (after the first compiled step a rank holds only its "
                        "stages)", reason, len(self.pending))
            self.materialize(list(self.pending.values()))

    def materialize(self, wanted: Iterable[ShardedParam]) -> int:
        """Initialize the pending parameters among ``wanted``; return how many."""
        todo = {id(s) for s in wanted} & self.pending.keys()
        if not todo:
            return 0
        work = copy.deepcopy(self.pristine)  # meta: free; the replay consumes its init plan
        devices = [self.device] if self.device.type == "cuda" else []
        count = 0
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.random.set_rng_state(self.rng[0])
            if devices:
                torch.cuda.set_rng_state(self.rng[1], self.device)
            seen: set[int] = set()
            for (_, copy_module), (_, module) in zip(
                    work.named_modules(), self.model.named_modules(), strict=True):
                fresh = materialize_direct(work, copy_module, self.device, seen,
                                           self.init_fn)
                for local, param in list(copy_module._parameters.items()):
                    if param is None or id(param) in seen:
                        continue
                    seen.add(id(param))
                    full = fresh.pop(local, None)
                    sharded: ShardedParam = module.__dict__[SHARD_PREFIX + local]
                    if full is not None and id(sharded) in todo:
                        restore(sharded, full, self.mesh)
                        del self.pending[id(sharded)]
                        sharded.deferred = None
                        count += 1
                del fresh
        log.info("initialized %d deferred parameters of this rank's stages", count)
        return count


def restore(sharded: ShardedParam, full: torch.Tensor, mesh: Mesh) -> None:
    """Give a released parameter its storage back, filled with this rank's part of ``full``."""
    flat = sharded.flat
    if sharded.record.op_stage in (2, 3):
        content = shard_of(full, mesh.dp, mesh.dp_index)
    else:
        content = full.reshape(-1)
    storage = flat.untyped_storage()
    storage.resize_(flat.numel() * flat.element_size())
    note_resized(flat)
    with torch.no_grad():
        flat.copy_(content.to(flat.dtype))
        local = sharded.local_view(flat.detach())
        if sharded.placement == "plain":
            sharded.visible.set_(local)
        else:
            sharded.visible._local_tensor = local
    sharded.held = True
