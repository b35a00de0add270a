"""Run a graph once per input signature on fake tensors; after that, replay what it made.

A planned step (``zeroc.world.fake_world``) runs every stage graph once per micro-batch on fake
tensors: with 16 micro-batches the same forward runs 16 times on inputs of the same shapes
and produces outputs of the same shapes each time, which costs seconds of fake dispatch per
pipeline position and tells nothing new. ``call(graph, args)`` runs ``graph`` for real on
the first call with a given input signature (shapes, strides, dtypes, devices, which inputs
share storage) and records:

- each output: a fresh storage (its size in bytes, and whether the output is a view of it),
  a view of one of the inputs (which, and how), the input itself, or a non-tensor constant;
- the most bytes alive at once among the storages the graph made, and which of its inputs'
  storages an op gave out (a ``StepMemory`` tracker counts those when it first sees them).

A later call with the same signature shows the step's tracker (and any whole-run ledger:
``step_memory.note_made``) the inputs' storages it gave out, raises their peaks by the
recorded transient and makes the outputs again (fresh fake storages of the recorded sizes,
the same views of its own inputs), so the step's memory figures are those of running the
graph: the same storages live after it, the same peak.

Only graphs that are pure on plain fake tensors are replayed: no collective or ZeRO op
inside (those must be issued every time), no input or output that is a tensor subclass or
requires a gradient, outputs whose storage is explained by the rules above. Anything else
runs every time. Real tensors always run: replaying is for fake tensors, which hold no values.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.fx

from zeroc.runtime.step_memory import (
    StepMemory,
    allocation_label,
    note_made,
    note_transient,
)
from zeroc.runtime.torch_compat import FakeTensor, disable_current_modes

__all__ = ["adds_nothing", "call", "is_view", "learned", "replayable"]

# Ops that talk to other ranks or count calls: a graph holding one runs every time.
_UNREPLAYABLE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d", "_dtensor"})
_UNREPLAYABLE_OPS = frozenset({"unshard", "reduce_grad"})


@dataclasses.dataclass(frozen=True)
class _Fresh:
    """An output in a storage the graph made: ``nbytes`` of ``dtype`` on ``device``."""

    group: int  # outputs of one group share one storage
    nbytes: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    view: bool  # made as a view of its storage's base (``_base`` set), else allocated
    # For a view: whether being one matters (it alone spans its whole storage, so the
    # executor would take it as a fresh gradient were it not a view): a replay marks it for
    # ``is_view``, having made it without ``_base`` like every replayed view.
    needs_base: bool = False


@dataclasses.dataclass(frozen=True)
class _OfInput:
    """An output that is input ``index`` itself, or a view of it (``offset``: from the
    input's own storage offset)."""

    index: int
    same: bool
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclasses.dataclass(frozen=True)
class _Constant:
    value: Any


@dataclasses.dataclass(frozen=True)
class _Record:
    outputs: tuple[Any, ...]
    transient: int  # the most bytes of storages the graph made alive at once
    touched: tuple[int, ...]  # inputs whose storage an op of the graph gave out
    as_tuple: bool


# graph -> {input signature -> _Record, or None when the graph cannot be replayed}
_LEARNED = [0]  # recordings made (``learned``)
_RECORDS: weakref.WeakKeyDictionary[Any, dict[Any, _Record | None]] = weakref.WeakKeyDictionary()
_PURE: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def replayable(graph: Any) -> bool:
    """Whether ``graph`` (an ``fx.GraphModule``, or a callable whose ``gm`` is one) holds no
    op that must run every time."""
    if graph in _PURE:
        return _PURE[graph]
    gm = getattr(graph, "gm", graph)  # an F&B graph wraps its GraphModule
    pure = isinstance(gm, torch.fx.GraphModule)
    if pure:
        for node in gm.graph.nodes:
            if node.op != "call_function":  # a tensor method is an op; a module may not be
                pure = node.op in ("placeholder", "output", "get_attr", "call_method")
            else:
                namespace = getattr(node.target, "namespace", None)
                name = getattr(getattr(node.target, "_schema", None), "name", "")
                pure = namespace not in _UNREPLAYABLE_NAMESPACES and not (
                    namespace == "zeroc" and name.split("::")[-1] in _UNREPLAYABLE_OPS)
            if not pure:
                break
    _PURE[graph] = pure
    return pure


def _signature(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The inputs' metadata and storage sharing, or None when one is not a plain fake."""
    storages: dict[int, int] = {}
    parts = []
    for index, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            if type(value) is not FakeTensor or value.requires_grad:
                return None
            first = storages.setdefault(value.untyped_storage()._cdata, index)
            # Not the storage offset: a micro-batch is a slice of the batch at its own offset.
            parts.append((tuple(value.shape), value.stride(),
                          value.dtype, value.device, first))
        elif value is None or isinstance(value, (bool, int, float)):
            parts.append(("value", value))
        else:
            return None
    if not storages:  # no fake tensor to take the fake mode from: run it
        return None
    return tuple(parts)


def _describe(outs: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """How to make ``outs`` again from new inputs, or None if the rules cannot say."""
    inputs = {}
    for index, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            inputs.setdefault(value.untyped_storage()._cdata, index)
    groups: dict[int, tuple[int, int, torch.dtype]] = {}  # storage -> group, nbytes, dtype
    owned: set[int] = set()  # storages one output (no view) owns
    described = []
    for out in outs:
        if not isinstance(out, torch.Tensor):
            if out is not None and not isinstance(out, (bool, int, float)):
                return None
            described.append(_Constant(out))
            continue
        if type(out) is not FakeTensor or out.requires_grad:
            return None
        key = out.untyped_storage()._cdata
        layout = (tuple(out.shape), out.stride(), out.storage_offset())
        if key in inputs:
            source = args[inputs[key]]
            if source.dtype != out.dtype:
                return None
            described.append(_OfInput(inputs[key], out is source, layout[0], layout[1],
                                      layout[2] - source.storage_offset()))
            continue
        nbytes = out.untyped_storage().nbytes()
        group = groups.setdefault(key, (len(groups), nbytes, out.dtype))
        view = out._base is not None
        if group[2] != out.dtype or nbytes % out.element_size() or (not view and (
                out.storage_offset() or nbytes != _span(out) * out.element_size()
                or key in owned)):
            return None  # e.g. one tensor returned twice: run such a graph every time
        if not view:
            owned.add(key)
        described.append(_Fresh(group[0], nbytes, *layout, out.dtype, out.device, view))
    members: dict[int, int] = {}
    for out in described:
        if isinstance(out, _Fresh):
            members[out.group] = members.get(out.group, 0) + 1
    return tuple(dataclasses.replace(out, needs_base=members[out.group] == 1 and not out.offset
                                     and _whole(out))
                 if isinstance(out, _Fresh) and out.view else out for out in described)


def _whole(out: _Fresh) -> bool:
    """Whether ``out``'s elements span exactly its storage."""
    return _span_of(out.size, out.stride) * out.dtype.itemsize == out.nbytes


def _span_of(size: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from the first to one past the last one a layout can address."""
    if any(n == 0 for n in size):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))


def _span(tensor: torch.Tensor) -> int:
    return _span_of(tuple(tensor.shape), tensor.stride())


def _remake(record: _Record, args: tuple[Any, ...]) -> Any:
    # A storage's base: its output that is no view (made first, so the views see it as
    # their ``_base`` as they did), else a flat tensor over the whole storage.
    bases: dict[int, torch.Tensor] = {}
    metas: dict[int, torch.Tensor] = {}  # each fresh storage's meta tensor
    made: dict[int, torch.Tensor] = {}
    mode = next(a.fake_mode for a in args if isinstance(a, FakeTensor))

    def allocate(size: tuple[int, ...], stride: tuple[int, ...], out: _Fresh) -> torch.Tensor:
        # As fake tensor mode makes an op's output, without dispatching an op (a third of
        # the time); the trackers are told of it as they would see it.
        meta = metas[out.group] = torch.empty_strided(size, stride, dtype=out.dtype,
                                                      device="meta")
        tensor = FakeTensor(mode, meta, out.device)
        note_made(tensor)
        return tensor

    def view(out: _Fresh) -> torch.Tensor:
        base = bases.get(out.group)
        if base is None:
            base = bases[out.group] = allocate((out.nbytes // out.dtype.itemsize,), (1,), out)
        # the same storage, without dispatching an op
        tensor = FakeTensor(mode, metas[out.group].as_strided(out.size, out.stride, out.offset),
                            out.device)
        if out.needs_base:  # no ``_base`` (no op made it): ``is_view`` tells instead
            tensor._zeroc_replayed_view = True
        return tensor

    outs = []
    # Every tensor below is made on meta and wrapped: no mode may see those ops (modes are
    # set aside once for the whole call; entering that costs as much as making a tensor).
    with disable_current_modes():
        for index, out in enumerate(record.outputs):
            if isinstance(out, _Fresh) and not out.view:
                made[index] = bases[out.group] = allocate(out.size, out.stride, out)
        for index, out in enumerate(record.outputs):
            if isinstance(out, _Constant):
                outs.append(out.value)
            elif isinstance(out, _OfInput):
                source = args[out.index]
                outs.append(source if out.same else _view_of_input(mode, source, out))
            elif not out.view:
                outs.append(made[index])
            else:
                outs.append(view(out))
    return tuple(outs) if record.as_tuple else outs


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view: it has a ``_base``, or it is a replayed output that was
    one when its graph ran (a replay makes it without dispatching an op, so without
    ``_base``)."""
    return tensor._base is not None or getattr(tensor, "_zeroc_replayed_view", False)


def _view_of_input(mode: Any, source: torch.Tensor, out: _OfInput) -> torch.Tensor:
    """``source.as_strided(...)`` without dispatching an op through fake tensor mode (most of
    a replay's time): a meta tensor set to ``source``'s own storage, wrapped. It has no
    ``_base``; nothing reads one of it: the executor's fresh-gradient test already fails on
    its storage, which an input of the same call shares. Called with modes set aside."""
    meta = torch.empty(0, dtype=source.dtype, device="meta")
    meta.set_(source.untyped_storage(), source.storage_offset() + out.offset, out.size,
              out.stride)
    return FakeTensor(mode, meta, source.device)


class _GraphMemory(StepMemory):
    """The bytes of the storages one graph run makes, apart from its inputs' (which existed
    before it), and which inputs an op of it gave out (a view of a weight, say): a step's
    tracker counts such a storage the first time it sees it, so a replay shows it those."""

    def __init__(self, args: tuple[Any, ...]) -> None:
        super().__init__()
        self.inputs = {}
        for index, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                self.inputs.setdefault(value.untyped_storage()._cdata, index)
        self.touched: set[int] = set()

    def _record(self, tensor: torch.Tensor) -> None:
        index = self.inputs.get(tensor.untyped_storage()._cdata)
        if index is None:
            super()._record(tensor)
        else:
            self.touched.add(index)


def call(graph: Any, *args: Any) -> Any:
    """``graph(*args)``, replayed when it ran before on inputs of the same signature."""
    with allocation_label("graph"):  # what a stage graph makes, for a whole-run ledger
        return _call(graph, *args)


def _call(graph: Any, *args: Any) -> Any:
    if not replayable(graph):
        return graph(*args)
    signature = _signature(args)
    if signature is None:
        return graph(*args)
    records = _RECORDS.setdefault(graph, {})
    record = records.get(signature, False)
    if record:
        for index in record.touched:
            note_made(args[index])
        note_transient(record.transient)
        return _remake(record, args)
    with _GraphMemory(args) as own:  # inside the step's tracker, if any: it sees the run too
        outs = graph(*args)
    if record is False:
        described = _describe(outs, args) if isinstance(outs, (tuple, list)) else None
        records[signature] = None if described is None else _Record(
            described, own.peak, tuple(sorted(own.touched)), isinstance(outs, tuple))
        _LEARNED[0] += described is not None
    return outs


def adds_nothing(target: torch.Tensor, value: Any) -> bool:
    """Whether ``target.add_(value)`` would change nothing a planned step measures: both are
    plain fake tensors of one shape, dtype and device, neither requiring a gradient, so the op
    has no values to add, makes no storage, broadcasts nothing and cannot fail (a step's
    gradient accumulation, once per micro-batch and parameter, skips it)."""
    return (type(target) is FakeTensor and type(value) is FakeTensor
            and not target.requires_grad and not value.requires_grad
            and target.shape == value.shape and target.dtype == value.dtype
            and target.device == value.device)


def learned() -> int:
    """How many graph runs this process has recorded for replay so far: a step during which
    it grew ran a graph that later steps replay."""
    return _LEARNED[0]
