"""What zeroc compiled for one ``torch.compile`` call: a session of compiled graphs.

Every ``torch.compile(..., backend="zeroc")`` call makes one compile wrapper object in torch;
the backend finds it on the call stack and keeps one ``CompileSession`` on it. Each Dynamo
graph compiled under it (graph breaks, recompiles) adds a ``CompiledGraph``. ``zeroc.explain``
walks from the compiled model or function back to that wrapper and builds the Plan.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from zeroc.config import Config
from zeroc.runtime.records import CollectiveInfo, GraphInfo, KernelInfo, ParamInfo, PassInfo

SESSION_ATTR = "_zeroc_session"


@dataclasses.dataclass
class CompiledGraph:
    """The mutable build record of one Dynamo graph while it compiles (frozen into the Plan)."""

    prefix: str
    params: tuple[ParamInfo, ...]
    dynamo_code: str
    device: str = "cpu"
    zero: int = -1  # ZeRO stage of the graph's parameters; -1: not parallelized
    zero_group: str = ""
    layout: Any = None  # the ZeroLayout of the graph's parameters (not part of the Plan)
    joint: GraphInfo | None = None
    num_fwd_outputs: int = 0
    saved_bytes: int = 0
    transient_bytes: int = 0
    graphs: list[GraphInfo] = dataclasses.field(default_factory=list)
    kernels: list[KernelInfo] = dataclasses.field(default_factory=list)
    collectives: list[CollectiveInfo] = dataclasses.field(default_factory=list)
    passes: list[PassInfo] = dataclasses.field(default_factory=list)
    # Inductor's output code by graph name (kernels="inductor"), for reading and FileCheck.
    output_code: dict[str, str] = dataclasses.field(default_factory=dict)
    # Graphs whose collectives Inductor ran in another order than zeroc's graph has them.
    collectives_moved: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CompileSession:
    """All graphs compiled under one ``torch.compile`` call, with the Config they used."""

    config: Config
    records: list[CompiledGraph] = dataclasses.field(default_factory=list)

    def next_graph_index(self) -> int:
        return len(self.records)

    def add(self, record: CompiledGraph) -> None:
        self.records.append(record)


def _is_compile_wrapper(obj: Any) -> bool:
    return type(obj).__name__ in ("_TorchCompileWrapper",) and hasattr(obj, "compiler_fn")


def find_compile_wrapper() -> Any | None:
    """The torch compile wrapper that is calling the backend now, from the call stack."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if _is_compile_wrapper(candidate):
            return candidate
        frame = frame.f_back
    return None


def session_for(wrapper: Any | None, config: Config) -> CompileSession:
    """The session kept on ``wrapper`` (made on first use); a fresh one if there is none."""
    if wrapper is None:
        return CompileSession(config)
    session = getattr(wrapper, SESSION_ATTR, None)
    if session is None:
        session = CompileSession(config)
        setattr(wrapper, SESSION_ATTR, session)
    return session


def wrapper_of(compiled: Any) -> Any | None:
    """Follow torch.compile's wrappers from a compiled model or function to the wrapper."""
    starts = []
    ctx = getattr(compiled, "dynamo_ctx", None)
    if ctx is not None:
        starts.append(getattr(ctx, "callback", None))
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            starts.append(cell.cell_contents)
        except ValueError:
            continue
    for obj in starts:
        for _ in range(16):
            if obj is None:
                break
            if _is_compile_wrapper(obj):
                return obj
            obj = getattr(obj, "_torchdynamo_orig_backend", None)
    return None
