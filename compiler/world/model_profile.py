"""One fake training step of the plain model, op by op: what ``zeroc.tune`` screens with.

``profile_model(model, example_inputs)`` runs the user's model (a meta copy, its parameters
made fake CPU tensors) forward and backward once under ``FakeTensorMode`` at one replica's
batch, and records every aten op the step dispatches: its FLOPs and bytes
(``zeroc.runtime.cost.cost.call_cost``), whether it is elementwise, which parameters it is the
first to read, and (for forward ops) how many of its output bytes autograd still holds when
the forward ends, i.e. what the backward needs. Nothing is compiled and no process group is
made, so this takes seconds where a plan of one layout takes tens of seconds; the tuner
screens every candidate layout on it (``zeroc.tuning.tune_screen``) and plans only the best in full.

What the screen needs beyond the costs, read off the step's dataflow (which op made each
tensor an op reads) and off the step as it runs:

- **what a recomputing partitioner saves** (``OpRecord.recompute_saved``, ``partitioner=
  "min_cut"``): an elementwise output the backward needs is recomputed from what it has
  anyway (kept outputs, parameters, inputs) when the outputs it would need kept instead (of
  the ops behind it that are not elementwise) are fewer bytes; otherwise it is kept. A Llama
  block keeps its residual stream, its scaled queries and keys and the attention's output
  (each one matrix product away) and recomputes its norms and SiLU product. Where parameters
  are gathered inside the graph (ZeRO-2/3 without a pipeline) an elementwise op that reads one
  (a norm's scale) is not recomputed, which would gather it again
  (``recompute_saved_sharded``).
- **the loss head** (``head``): the ops from the last one that reads a parameter (the output
  projection) on. Its largest output is the logits (``logits_bytes``), which the fused loss
  never holds, unless the model returns them (``logits_returned``: a graph that outputs them
  keeps them; a pipeline drops them). A long sequence's attention scores (``heads x seq x
  seq``) may be the step's largest output instead.
- **where a pipeline may cut** (``block_starts``): the first op of each repeated block (the
  children ``0, 1, ...`` of a module, all of one type), chosen as ``zeroc.passes.front.stage_units``
  chooses them: the container with the most compute, and others outside it with a tenth.
- **the backward's working set** (``backward_working``; ``head_working`` while the loss head's
  backward runs): the most bytes the backward itself has alive at once (activation gradients,
  temporaries; parameter gradients are dropped as they arrive, what the forward saved is not
  counted).

Values never exist: a model that reads one (``.item()``, data-dependent branches) raises, as
planning does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from zeroc.runtime.cost.cost import call_cost, is_alias, is_pointwise, tensor_bytes
from zeroc.runtime.torch_compat import FakeTensorMode, TorchDispatchMode, tree_leaves

__all__ = ["ModelProfile", "OpRecord", "profile_model"]


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One forward op at the profiled batch: its cost, the output bytes the backward keeps
    (``saved``; ``recompute_saved`` and ``recompute_saved_sharded`` under a recomputing
    partitioner, see the module), the bytes of parameters it reads first (``param_bytes``),
    whether it is elementwise and whether it reads a parameter at all (``reads_param``)."""

    flops: int
    bytes: int
    saved: int
    param_bytes: int
    out_bytes: int
    pointwise: bool
    recompute_saved: int = 0
    recompute_saved_sharded: int = 0
    reads_param: bool = False


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """A training step of the plain model at one replica's batch of ``rows`` rows."""

    rows: int
    forward: tuple[OpRecord, ...]
    backward: tuple[OpRecord, ...]  # saved and param_bytes are 0: nothing outlives the step
    param_bytes: int
    param_tensors: int
    head: int = 0  # the loss head's first forward op: the last one that reads a parameter
    block_starts: tuple[int, ...] = ()  # the first forward op of each repeated block
    backward_working: int = 0  # the backward's own bytes at most, after the loss head's
    head_working: int = 0  # the same while the loss head's backward runs
    logits_returned: bool = False  # the model's output holds its logits beside the loss

    def logits_bytes(self) -> int:
        """The largest output of the loss head (``head`` on): a language model's logits."""
        return max((op.out_bytes for op in self.forward[self.head:]), default=0)


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class _Recorder(TorchDispatchMode):
    """Records each op's cost; in the forward also its parameters and output storages."""

    def __init__(self, params: dict[int, int]) -> None:
        super().__init__()
        self.params = params  # storage key -> bytes, popped when first read
        self.param_keys = set(params)
        self.backward = False
        self.ops: list[dict[str, Any]] = []
        self.backward_ops: list[OpRecord] = []
        self.made: dict[int, int] = {}  # storage key -> the forward op that last wrote it
        self.inputs: list[tuple[int, ...]] = []  # per forward op: the ops that made its inputs
        self.last_param_read = 0
        self.head_params: set[int] = set()  # storage keys the last parameter read reads
        self.open_blocks: list[tuple[int, int]] = []  # (container, block index) entered now
        self.blocks: list[tuple[tuple[int, int], ...]] = []  # per forward op: open_blocks

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
        param_bytes, made, read = 0, [], set()
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                key = _storage_key(leaf)
                param_bytes += self.params.pop(key, 0)
                if key in self.param_keys:
                    read.add(key)
                elif key in self.made:
                    made.append(self.made[key])
        if read:
            self.last_param_read, self.head_params = len(self.ops), read
        self.inputs.append(tuple(dict.fromkeys(made)))
        self.blocks.append(tuple(self.open_blocks))
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for tensor in outputs:
            self.made[_storage_key(tensor)] = len(self.ops)
        self.ops.append({"flops": flops, "bytes": moved, "param_bytes": param_bytes,
                         "out_bytes": tensor_bytes(out), "pointwise": is_pointwise(func),
                         "reads_param": bool(read),
                         "refs": [weakref.ref(t.untyped_storage()) for t in outputs]})
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
        containers = _containers(replica)
        with recorder, _watching_blocks(containers, recorder.open_blocks):
            output = replica(*args, **kwargs)
            loss = loss_of(output, "zeroc.tuning.tune")
        returned = {_storage_key(t) for t in tree_leaves(
            list(output.values()) if isinstance(output, dict) else output)
            if isinstance(t, torch.Tensor) and t is not loss}
        del output
        gc.collect()  # what the forward made and autograd does not hold is gone now
        alive: dict[int, Any] = {}  # id -> storage the backward finds alive
        forward = []
        for op in recorder.ops:
            saved = 0
            for ref in op.pop("refs"):
                storage = ref()
                if storage is not None and id(storage) not in alive:
                    alive[id(storage)] = storage
                    saved += storage.nbytes()
            forward.append(OpRecord(saved=saved, **op))
        recorder.backward = True
        owned = dict.fromkeys(replica.parameters())
        head_params = [p for p in owned if _storage_key(p) in recorder.head_params]
        working = _BackwardWorkingSet(list(owned), head_params,
                                      [*alive.values(), *(p.untyped_storage() for p in owned)])
        del alive
        with recorder, working:
            _backward_for(device)(loss)
        del loss
    forward = _with_recompute_saved(forward, recorder.inputs)
    head = recorder.last_param_read
    logits = max((op.out_bytes for op in forward[head:]), default=0)
    logits_made = {i for i in range(head, len(forward)) if forward[i].out_bytes * 2 >= logits}
    return ModelProfile(rows=rows, forward=tuple(forward),
                        backward=tuple(recorder.backward_ops), param_bytes=total,
                        param_tensors=tensors, head=recorder.last_param_read,
                        block_starts=_block_starts(forward, recorder.blocks, containers),
                        backward_working=working.body, head_working=working.head,
                        logits_returned=any(recorder.made.get(k) in logits_made
                                            for k in returned))


class _BackwardWorkingSet(TorchDispatchMode):
    """The backward's own bytes alive at once: every storage an op makes that is not one of
    ``existing`` (what the forward saved, the parameters), counted until it is freed;
    parameter gradients are dropped as they arrive. ``head``: the most while the loss head's
    backward runs (until every parameter of ``head_params`` has its gradient); ``body``: the
    most after it."""

    def __init__(self, params: list[torch.Tensor], head_params: list[torch.Tensor],
                 existing: list[Any]) -> None:
        super().__init__()
        self.head = self.body = self.live = self.peak = 0
        self._seen: dict[int, int] = {}
        for storage in existing:  # an op that gives one out (a view) makes nothing new
            self._track(storage, 0)
        self._waiting = {id(p) for p in head_params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._arrived)
                       for p in params if p.requires_grad]

    def _track(self, storage: Any, nbytes: int) -> None:
        self._seen[id(storage)] = nbytes
        weakref.finalize(storage, self._free, id(storage))

    def _free(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor) and id(value.untyped_storage()) not in self._seen:
                storage = value.untyped_storage()
                self._track(storage, storage.nbytes())
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
        return out

    def _arrived(self, param: torch.Tensor) -> None:
        param.grad = None
        if id(param) in self._waiting:
            self._waiting.discard(id(param))
            if not self._waiting:  # the head is done: the body's peak starts from here
                self.head, self.peak = self.peak, self.live

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        if self._waiting:  # the head's parameters never got gradients: all of it is "head"
            self.head, self.peak = self.peak, 0
        self.body = self.peak


def _containers(model: torch.nn.Module) -> list[tuple[str, list[torch.nn.Module]]]:
    """Every module whose children ``0, 1, ...`` (at least two) are all of one type, with them."""
    found = []
    for name, module in model.named_modules():
        blocks = [child for key, child in module.named_children() if key.isdigit()]
        if len(blocks) >= 2 and len({type(b) for b in blocks}) == 1:
            found.append((name, blocks))
    return found


@contextlib.contextmanager
def _watching_blocks(containers: list[tuple[str, list[torch.nn.Module]]],
                     open_blocks: list[tuple[int, int]]) -> Iterator[None]:
    """Keep ``open_blocks`` as the (container, block index) pairs whose forward runs now."""
    hooks = []
    for c, (_, blocks) in enumerate(containers):
        for b, block in enumerate(blocks):
            pair = (c, b)
            hooks.append(block.register_forward_pre_hook(
                lambda *_, pair=pair: open_blocks.append(pair)))
            hooks.append(block.register_forward_hook(
                lambda *_, pair=pair: open_blocks.remove(pair), always_call=True))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _block_starts(forward: list[OpRecord], blocks: list[tuple[tuple[int, int], ...]],
                  containers: list[tuple[str, list[torch.nn.Module]]]) -> tuple[int, ...]:
    """The first op of each block of the containers a pipeline cuts (as
    ``zeroc.passes.front.stage_units.find_blocks`` picks them: the most compute, FLOPs plus
    ``FLOPS_PER_BYTE`` per byte, first; others outside it with ``OTHER_CONTAINER_SHARE`` of it)."""
    from zeroc.passes.front.stage_balance import FLOPS_PER_BYTE
    from zeroc.passes.front.stage_units import OTHER_CONTAINER_SHARE

    totals: dict[int, float] = {}
    for op, pairs in zip(forward, blocks, strict=True):
        for c in {c for c, _ in pairs}:
            totals[c] = totals.get(c, 0.0) + op.flops + FLOPS_PER_BYTE * op.bytes
    ranked = sorted(totals, key=lambda c: (-totals[c], containers[c][0].count(".")))
    chosen: list[int] = []
    for c in ranked:
        if chosen and totals[c] < OTHER_CONTAINER_SHARE * totals[ranked[0]]:
            break
        name = containers[c][0]
        if not any(_encloses(name, containers[o][0]) or _encloses(containers[o][0], name)
                   for o in chosen):
            chosen.append(c)
    starts, seen = [], set()
    for index, pairs in enumerate(blocks):
        block = next((pair for pair in pairs if pair[0] in chosen), None)
        if block is not None and block not in seen:
            seen.add(block)
            starts.append(index)
    return tuple(starts)


def _encloses(outer: str, inner: str) -> bool:
    return outer == "" or inner == outer or inner.startswith(outer + ".")


# How many elementwise ops behind one the recompute walk visits before it gives up (and the
# op's output is saved): a chain a partitioner would recompute is short.
_MAX_RECOMPUTE_WALK = 64


def _with_recompute_saved(forward: list[OpRecord],
                          inputs: list[tuple[int, ...]]) -> list[OpRecord]:
    """``forward`` with each op's ``recompute_saved`` and ``recompute_saved_sharded`` (see
    the module): what the backward keeps of its output when elementwise outputs are
    recomputed wherever that saves bytes; sharded, an elementwise op that reads a parameter
    is never recomputed."""
    free = _kept(forward, inputs, lambda op: op.pointwise)
    sharded = _kept(forward, inputs, lambda op: op.pointwise and not op.reads_param)
    return [dataclasses.replace(op, recompute_saved=a, recompute_saved_sharded=b)
            for op, a, b in zip(forward, free, sharded, strict=True)]


def _kept(forward: list[OpRecord], inputs: list[tuple[int, ...]],
          recomputable: Callable[[OpRecord], bool]) -> list[int]:
    """Per op, the output bytes the backward keeps. In forward order: an output the
    backward needs (``saved``) of an op that is ``recomputable`` is recomputed when the
    outputs it would need that are not kept already (those of the ops behind it that are
    not recomputable, walking back through recomputable ops that are not kept) are fewer
    bytes; they are kept instead. Every other output the backward needs is kept."""
    kept = [0] * len(forward)
    for index, op in enumerate(forward):
        if not op.saved:
            continue
        if not recomputable(op):
            kept[index] = op.saved
            continue
        roots: set[int] = set()
        seen: set[int] = set()
        stack = list(inputs[index])
        while stack and len(seen) <= _MAX_RECOMPUTE_WALK:
            j = stack.pop()
            if j in seen or kept[j]:
                continue
            seen.add(j)
            if recomputable(forward[j]):
                stack.extend(inputs[j])
            else:
                roots.add(j)
        instead = sum(forward[j].out_bytes for j in roots)
        if len(seen) > _MAX_RECOMPUTE_WALK or instead >= op.saved:
            kept[index] = op.saved
        else:
            for j in roots:
                kept[j] = forward[j].out_bytes
    return kept
