"""The Plan: an immutable, printable, JSON-round-tripping record of what zeroc compiled.

A Plan holds the meta data (versions, world, options, graph hash), the compiled graphs with
their costs, the stages, the parameters, the kernels, the collectives, the memory estimate per
rank and every pass's graph before and after. ``str(plan)`` prints tables; ``to_json`` and
``Plan.from_json`` round-trip exactly (``Plan.from_json(p.to_json()) == p``).
``plan.schedule_grid(ranks, width)`` draws a pipeline's schedule grid for chosen ranks.
``str(plan)`` cuts long tables to their first rows and shows only the options that differ from
the defaults; ``str(plan.full())`` shows every row and every option (``full()`` changes only
how the plan prints: it compares equal and has the same JSON).

Kernel names are unique within a plan: ``<graph>.<the kernel's function in its source>``
(``g0.backward.zeroc_red_2``); ``plan.kernel(name)`` finds one.

A kernel's ``block`` is the launch configuration: zeroc's generated kernels report the one
they really launched with once they have run (``record_launch``, called at the first launch;
the plan is built from the compile records, which are made before any launch), and the
expected one before that.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
import weakref
from collections.abc import Sequence
from typing import Any

from zeroc.runtime.plan.records import (
    CollectiveInfo,
    GraphInfo,
    KernelInfo,
    MemoryEstimate,
    ParamInfo,
    PassInfo,
    PipelineInfo,
    StageInfo,
    StepEstimate,
)

PLAN_FORMAT = 1

Block = tuple[tuple[str, int], ...]
# id(KernelInfo) -> (weak reference to it, the configuration it launched with).
_launched: dict[int, tuple[weakref.ref, Block]] = {}


def record_launch(info: KernelInfo, block: Block) -> None:
    """Record that the kernel of the compile record ``info`` launched with ``block``; plans
    built afterwards show ``block`` for it."""
    key = id(info)
    _launched[key] = (weakref.ref(info, lambda _ref, key=key: _launched.pop(key, None)),
                      tuple(block))


def launched(info: KernelInfo) -> KernelInfo:
    """``info`` with the launch configuration recorded for it, if any."""
    entry = _launched.get(id(info))
    if entry is None or entry[0]() is not info or entry[1] == info.block:
        return info
    return dataclasses.replace(info, block=entry[1])


@dataclasses.dataclass(frozen=True)
class PlanMeta:
    """Where and how the plan was made."""

    format: int
    zeroc_version: str
    torch_version: str
    triton_version: str
    device: str
    world_size: int
    mesh: tuple[tuple[str, int], ...]
    zero: int
    schedule: str
    options: tuple[tuple[str, str], ...]
    graph_hash: str
    # Every option's default (same keys as ``options``); the header shows the ones that differ.
    option_defaults: tuple[tuple[str, str], ...] = ()
    # parallelize(layout="auto"): the zeroc.tune cache file the layout came from ("": none)
    # and what of the model matched it (structure, world, versions, input shapes).
    layout_from: str = ""
    layout_match: str = ""


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything zeroc decided for one compiled model or function."""

    meta: PlanMeta
    graphs: tuple[GraphInfo, ...]
    stages: tuple[StageInfo, ...]
    params: tuple[ParamInfo, ...]
    kernels: tuple[KernelInfo, ...]
    collectives: tuple[CollectiveInfo, ...]
    memory: tuple[MemoryEstimate, ...]
    passes: tuple[PassInfo, ...]
    pipeline: PipelineInfo | None = None
    estimate: StepEstimate | None = None  # planned jobs (explain(world=...)) on a profile
    # Print every row and option (``full()``); not part of equality or of the JSON.
    show_all: bool = dataclasses.field(default=False, compare=False, repr=False,
                                       metadata={"json": False})

    def __post_init__(self) -> None:
        # The kernels' launched configurations, recorded after the compile records were made.
        object.__setattr__(self, "kernels", tuple(launched(k) for k in self.kernels))

    def to_json(self, indent: int | None = None) -> str:
        """The plan as JSON text."""
        return json.dumps(_to_plain(self), indent=indent, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Plan:
        """Rebuild a Plan from ``to_json`` output."""
        return _from_plain(Plan, json.loads(text))

    def digest(self) -> str:
        """A short hash of the plan's content (the same plan gives the same digest)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def graph(self, name: str) -> GraphInfo:
        """The compiled graph called ``name`` (e.g. ``"g0.forward"``)."""
        for graph in self.graphs:
            if graph.name == name:
                return graph
        raise KeyError(f"no graph {name!r} in the plan; graphs: {[g.name for g in self.graphs]}")

    def full(self) -> Plan:
        """This plan, printing every row of every table and every option."""
        return dataclasses.replace(self, show_all=True)

    def kernel(self, name: str) -> KernelInfo:
        """The kernel called ``name`` (``"g0.forward.zeroc_red_0"``, as ``str(plan)`` shows)."""
        for kernel in self.kernels:
            if kernel.name == name:
                return kernel
        raise KeyError(f"no kernel {name!r} in the plan; kernels: "
                       f"{[k.name for k in self.kernels]}")

    def passes_for(self, graph: str) -> tuple[PassInfo, ...]:
        """The pass records of one graph, in the order the passes ran."""
        return tuple(p for p in self.passes if p.graph == graph)

    def chrome_trace(self, path: str) -> str:
        """Write the last measured pipeline step as a Chrome/Perfetto trace; return ``path``.

        One track per rank, one slice per action group. Raises ``ValueError`` when the plan
        has no measured pipeline step (not pipelined, or not run yet).
        """
        from zeroc.runtime.plan.chrome_trace import write_chrome_trace

        if self.pipeline is None:
            raise ValueError("plan.chrome_trace: this plan has no pipeline (compile a model "
                             "parallelized with pp > 1 and run one step first)")
        return write_chrome_trace(self.pipeline, path)

    def schedule_grid(self, ranks: Sequence[int] | None = None, width: int | None = None) -> str:
        """The pipeline's schedule grid, drawn for ``ranks`` and wrapped at ``width``.

        ``ranks`` defaults to all of up to 8 ranks, else the first two, the middle one and the
        last two (as in ``str(plan)``); ``width`` to the terminal's width (100 without one), at
        least 60. Raises ``ValueError`` when the plan has no pipeline.
        """
        from zeroc.runtime.plan.schedule_grid import pipeline_grid

        if self.pipeline is None:
            raise ValueError("plan.schedule_grid: this plan has no pipeline (compile a model "
                             "parallelized with pp > 1 first)")
        return pipeline_grid(self.pipeline, ranks, width)

    def __str__(self) -> str:
        from zeroc.runtime.plan.plan_text import MAX_ROWS, render_plan

        return render_plan(self, max_rows=None if self.show_all else MAX_ROWS,
                           all_options=self.show_all)


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.metadata.get("json", True)}
    if isinstance(value, (tuple, list)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_plain(v) for k, v in value.items()}
    return value


def _from_plain(hint: Any, value: Any) -> Any:
    """Rebuild ``value`` as the type ``hint`` (dataclasses, tuples, scalars); a field that
    ``value`` lacks (a plan written before the field existed) takes its default."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return hint(**{f.name: _from_plain(hints[f.name], value[f.name])
                       for f in dataclasses.fields(hint) if f.name in value})
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_plain(args[0], v) for v in value)
        return tuple(_from_plain(a, v) for a, v in zip(args, value, strict=True))
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if arg is type(None) and value is None:
                return None
        return _from_plain(next(a for a in typing.get_args(hint) if a is not type(None)), value)
    return value
