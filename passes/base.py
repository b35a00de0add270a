"""The pass protocol: a pass is ``def name(gm, ctx) -> PassResult``.

``run_passes`` applies a literal list of passes to one graph. After each pass it lints the
graph, recompiles it, and records the graph text before and after (provenance), so that
``zeroc.explain`` can show what every pass did.

What the passes rewrite is an ``fx.GraphModule`` or any IR that is a ``PassSubject`` (a
pipeline program): it says how it reads as text, how big it is and how it is checked, which
``run_passes`` uses in place of ``graph_text``, ``count_nodes`` and ``graph.lint()``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.fx

from zeroc.runtime.plan.records import PassInfo
from zeroc.runtime.torch_compat import LazyGraphModule

log = logging.getLogger(__name__)


@runtime_checkable
class PassSubject(Protocol):
    """An IR other than an ``fx.GraphModule`` that passes rewrite (``run_passes``)."""

    def pass_text(self) -> str:
        """Readable text: the pass table's before/after."""
        ...

    def pass_size(self) -> int:
        """The pass table's "nodes" before/after."""
        ...

    def pass_check(self) -> None:
        """Lint: raise if the IR is inconsistent."""
        ...


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What a pass returns: the (possibly new) graph or ``PassSubject`` (``gm``, also read as
    ``ir``), whether it changed, and counters."""

    gm: Any
    changed: bool
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def ir(self) -> Any:
        """``gm`` under the name that fits an IR that is not a graph."""
        return self.gm


@dataclasses.dataclass
class PassContext:
    """State shared by the passes that run over one graph.

    ``config`` is the frozen Config; ``graph_name`` names the graph in the plan (e.g.
    ``"g0.forward"``); ``kind`` is ``"forward"``, ``"backward"`` or ``"inference"``.
    ``kernels`` collects the kernel records (``zeroc.runtime.plan.plan.KernelInfo``) produced by
    codegen; ``collectives`` and ``extras`` let later passes publish facts for the plan.
    """

    config: Any
    graph_name: str
    kind: str
    device: torch.device = torch.device("cpu")
    # The planned world (``zeroc.runtime.world.PlannedWorld``) the graph is compiled for;
    # None: a real run. Its collectives then run on a fake group that moves nothing.
    planned: Any = None
    kernels: list[Any] = dataclasses.field(default_factory=list)
    collectives: list[Any] = dataclasses.field(default_factory=list)
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PassRecord:
    """Provenance of one pass over one graph: the readable graph before and after."""

    pass_name: str
    graph_name: str
    changed: bool
    nodes_before: int
    nodes_after: int
    before: str
    after: str
    stats: dict[str, Any]


GraphPass = Callable[[Any, PassContext], PassResult]


def pass_infos(records: list[PassRecord]) -> list[PassInfo]:
    """The plan's frozen form of pass records (stats as sorted string pairs)."""
    return [
        PassInfo(pass_name=r.pass_name, graph=r.graph_name, changed=r.changed,
                 nodes_before=r.nodes_before, nodes_after=r.nodes_after, before=r.before,
                 after=r.after, stats=tuple(sorted((k, str(v)) for k, v in r.stats.items())))
        for r in records
    ]


def graph_module(root: torch.nn.Module, graph: torch.fx.Graph,
                 class_name: str = "GraphModule") -> torch.fx.GraphModule:
    """``torch.fx.GraphModule(root, graph, class_name)`` whose Python code is generated when
    it is first run or its code is read, not at every ``recompile()`` (torch's
    ``_LazyGraphModule``, which Inductor uses for the same reason): the passes rewrite and
    recompile a graph many times, and the pipeline front's whole-model graphs never run at
    all (only the stage graphs cut from them do). Its text (``graph_text``) is printed from
    the graph, as always."""
    return LazyGraphModule(root, graph, class_name)


def graph_text(gm: torch.fx.GraphModule) -> str:
    """The graph as readable Python-like text (one line per node)."""
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


def count_nodes(gm: torch.fx.GraphModule) -> int:
    """Nodes that do work: calls, not placeholders or the output."""
    return sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output"))


def _subject_text(subject: Any) -> str:
    return graph_text(subject) if isinstance(subject, torch.fx.GraphModule) else \
        subject.pass_text()


def _subject_size(subject: Any) -> int:
    return count_nodes(subject) if isinstance(subject, torch.fx.GraphModule) else \
        subject.pass_size()


def _check_subject(subject: Any, pass_name: str) -> None:
    """Lint and recompile a graph; ``pass_check`` any other ``PassSubject``."""
    if isinstance(subject, torch.fx.GraphModule):
        subject.graph.lint()
        subject.recompile()
    elif isinstance(subject, PassSubject):
        subject.pass_check()
    else:
        raise TypeError(f"pass {pass_name} returned a {type(subject).__name__}, which is "
                        "neither an fx.GraphModule nor a PassSubject")


def run_passes(
    gm: Any,
    ctx: PassContext,
    passes: Sequence[GraphPass],
    record: bool = True,
) -> tuple[Any, list[PassRecord]]:
    """Apply ``passes`` in order to ``gm`` (an ``fx.GraphModule`` or a ``PassSubject``);
    return the final one and one record per pass.

    Each pass's stats are logged at DEBUG (``TORCH_LOGS="+zeroc"``)."""
    records: list[PassRecord] = []
    debug = log.isEnabledFor(logging.DEBUG)
    if not isinstance(gm, (torch.fx.GraphModule, PassSubject)):
        raise TypeError(f"run_passes takes an fx.GraphModule or a PassSubject, not a "
                        f"{type(gm).__name__}")
    text = _subject_text(gm) if record else ""
    for graph_pass in passes:
        before = text  # a pass's graph before is the previous pass's graph after
        n_before = _subject_size(gm)
        start = time.perf_counter()
        result = graph_pass(gm, ctx)
        if not isinstance(result, PassResult):
            raise TypeError(f"pass {graph_pass.__name__} returned {type(result).__name__}, "
                            "expected PassResult")
        gm = result.gm
        _check_subject(gm, graph_pass.__name__)
        text = _subject_text(gm) if record else ""
        records.append(
            PassRecord(
                pass_name=graph_pass.__name__,
                graph_name=ctx.graph_name,
                changed=result.changed,
                nodes_before=n_before,
                nodes_after=_subject_size(gm),
                before=before,
                after=text,
                stats=dict(result.stats),
            )
        )
        if debug:
            last = records[-1]
            log.debug("zeroc: %s: pass %s %s, %d -> %d nodes in %.1f ms%s", ctx.graph_name,
                      last.pass_name, "changed" if last.changed else "unchanged",
                      last.nodes_before, last.nodes_after,
                      1e3 * (time.perf_counter() - start),
                      "".join(f", {k}={v}" for k, v in sorted(last.stats.items())))
    return gm, records
