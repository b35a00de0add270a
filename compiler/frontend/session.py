"""What zeroc compiled for one ``torch.compile`` call: a session of compiled graphs.

Every ``torch.compile(..., backend="zeroc")`` call (``model.compile(...)`` too) makes one
compile wrapper object in torch; zeroc keeps one ``CompileSession`` on it. Each Dynamo graph
compiled under it (graph breaks, recompiles) adds a ``Program`` (built with a mutable
``CompiledGraph`` record, frozen into the Program each time the Program changes).
``zeroc.explain`` goes from the compiled model or function to that wrapper and builds the
Plan from the session's Programs.

How the wrapper is found, on both sides, without the Python call stack (torch 2.11 and 2.13
expose the same attributes; ``tests/test_explain_forms.py`` covers every one of them):

- the backend side: ``torch._dynamo.symbolic_convert.InstructionTranslator.current_tx()`` is
  the translator of the frame Dynamo compiles now; its ``output.compiler_fn`` is the backend
  as that ``torch.compile`` call wrapped it;
- the compiled side: an ``OptimizedModule``'s ``dynamo_ctx.callback``; a compiled function's
  closure holds the same callback (and its ``OptimizeContext``, whose ``callback`` it is);
  ``module.compile()`` stores such a function as ``module._compiled_call_impl``;
- both ends are followed down the ``_torchdynamo_orig_backend`` chain, which torch documents
  (``torch/_dynamo/convert_frame.py``) as the way to recover the original backend; its last
  object (torch's ``_TorchCompileWrapper``, one per call) carries the session. A chain that
  ends in a plain function (``torch._dynamo.optimize(zeroc_backend)``, one function for every
  call) keeps the session on the wrapper just above it.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

from zeroc.frontend.config import Config
from zeroc.runtime.plan.records import CollectiveInfo, GraphInfo, KernelInfo, ParamInfo, PassInfo
from zeroc.runtime.program import Program, ProgramRecord, frozen_mapping

SESSION_ATTR = "_zeroc_session"
_CHAIN = "_torchdynamo_orig_backend"


@dataclasses.dataclass
class CompiledGraph:
    """The mutable build record of one Dynamo graph while it compiles; ``frozen()`` is the
    ``ProgramRecord`` its Program carries (the session re-freezes it on every Program change)."""

    prefix: str
    params: tuple[ParamInfo, ...]
    device: str = "cpu"
    zero: int = -1  # ZeRO stage of the graph's parameters; -1: not parallelized
    zero_group: str = ""
    joint: GraphInfo | None = None
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
    # Called after a change made once the Program was set (a graph Inductor compiles on its
    # first call): the session freezes the record into a new Program.
    on_change: Any = dataclasses.field(default=None, repr=False, compare=False)

    def changed(self) -> None:
        """This record changed after its Program was set: the Program gets it anew."""
        if self.on_change is not None:
            self.on_change()

    def frozen(self) -> ProgramRecord:
        """This record as it stands now, frozen (the same info objects: a kernel's measured
        launch configuration is found by its identity)."""
        return ProgramRecord(
            params=tuple(self.params), device=self.device, zero=self.zero,
            zero_group=self.zero_group, joint=self.joint, graphs=tuple(self.graphs),
            kernels=tuple(self.kernels), collectives=tuple(self.collectives),
            passes=tuple(self.passes), saved_bytes=self.saved_bytes,
            transient_bytes=self.transient_bytes, output_code=frozen_mapping(self.output_code),
            collectives_moved=tuple(self.collectives_moved))


@dataclasses.dataclass
class CompileSession:
    """All graphs compiled under one ``torch.compile`` call, with the Config they used.

    ``programs`` are the frozen ``Program`` each Dynamo graph runs, by its prefix (``g0``), as
    it stands now: a Program is never changed, so a graph compiled later (pp = 1's backward,
    on the first backward) gives a new Program in its place, with its build record frozen
    again (``Program.record``: what the Plan reads). ``building`` are those records while
    they are written, by prefix; ``executors`` what runs each pipelined Program (its timings
    are what the plan shows as measured).
    """

    config: Config
    building: dict[str, CompiledGraph] = dataclasses.field(default_factory=dict)
    programs: dict[str, Program] = dataclasses.field(default_factory=dict)
    executors: dict[str, Any] = dataclasses.field(default_factory=dict)

    def next_graph_index(self) -> int:
        return len(self.building)

    def add(self, record: CompiledGraph) -> None:
        """``record`` is written while its Dynamo graph compiles (its prefix is new)."""
        self.building[record.prefix] = record
        record.on_change = lambda: self._refresh(record.prefix)

    def _refresh(self, prefix: str) -> None:
        if prefix in self.programs:
            self.programs[prefix] = self._recorded(self.programs[prefix])

    def _recorded(self, program: Program) -> Program:
        record = self.building.get(program.name)
        return program if record is None else dataclasses.replace(program,
                                                                  record=record.frozen())

    def set_program(self, program: Program, executor: Any = None) -> None:
        """``program`` is what its Dynamo graph runs from now on (``executor`` runs it, for a
        pipelined one), with its build record as it stands."""
        self.programs[program.name] = self._recorded(program)
        if executor is not None:
            self.executors[program.name] = executor

    def add_graph(self, program_name: str, name: str, graph: Any) -> None:
        """A graph of ``program_name`` compiled after its Program was built: a new Program
        with it (and the record's rows of it) takes that Program's place."""
        self.programs[program_name] = self._recorded(
            self.programs[program_name].with_graph(name, graph))

    def records(self) -> list[ProgramRecord]:
        """The build records of the Programs, in compile order (what the Plan reads)."""
        return [p.record for p in self.programs.values()]

    def pipelined(self) -> Program | None:
        """The pipelined (pp > 1) Program of this session, if it compiled one: the latest that
        trains, else the latest (an evaluation program has forward-only stages)."""
        pipelined = [p for p in reversed(self.programs.values()) if p.schedule is not None]
        return next((p for p in pipelined if any(s.forward is not None for s in p.stages)),
                    pipelined[0] if pipelined else None)

    def pipelined_executor(self) -> Any:
        """What runs ``pipelined()`` (its ``PipelineExecutor``), or None."""
        program = self.pipelined()
        return None if program is None else self.executors.get(program.name)


def _innermost(obj: Any) -> Any:
    """The end of ``obj``'s ``_torchdynamo_orig_backend`` chain, above a plain function."""
    for _ in range(32):
        inner = getattr(obj, _CHAIN, None)
        if inner is None or isinstance(inner, (types.FunctionType, types.BuiltinFunctionType)):
            return obj
        obj = inner
    return obj


def find_compile_wrapper() -> Any | None:
    """The wrapper of the ``torch.compile`` call whose frame Dynamo is compiling now.

    ``None`` when the backend is called outside Dynamo (then the graph gets a session of its
    own, which no compiled object leads to).
    """
    from zeroc.runtime.torch_compat import current_translator

    tx = current_translator()
    if tx is None:  # no frame is being translated
        return None
    compiler_fn = getattr(getattr(tx, "output", None), "compiler_fn", None)
    return None if compiler_fn is None else _innermost(compiler_fn)


def session_for(wrapper: Any | None, config: Config) -> CompileSession:
    """The session kept on ``wrapper`` (made on first use); a fresh one if there is none."""
    if wrapper is None:
        return CompileSession(config)
    session = getattr(wrapper, SESSION_ATTR, None)
    if session is None:
        session = CompileSession(config)
        setattr(wrapper, SESSION_ATTR, session)
    return session


def _callbacks(compiled: Any) -> list[Any]:
    """The Dynamo callbacks ``compiled`` holds: its own, not its submodules'."""
    starts = []
    ctx = getattr(compiled, "dynamo_ctx", None)  # an OptimizedModule
    if ctx is not None:
        starts.append(getattr(ctx, "callback", None))
    impl = vars(compiled).get("_compiled_call_impl") if hasattr(compiled, "__dict__") else None
    for function in (compiled, impl):  # a compiled function; module.compile()'s one
        for cell in getattr(function, "__closure__", None) or ():
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            starts += [content, getattr(content, "callback", None)]
    return [s for s in starts if s is not None and hasattr(s, _CHAIN)]


def wrapper_of(compiled: Any) -> Any | None:
    """The compile wrapper of the ``torch.compile`` call that made ``compiled``, or ``None``.

    ``compiled`` is what ``torch.compile`` returned (a module or a function), or a module
    whose ``compile()`` method was called. Its submodules are not looked at
    (``compiled_regions`` does).
    """
    starts = _callbacks(compiled)
    return _innermost(starts[0]) if starts else None


def compiled_regions(model: Any) -> list[tuple[str, Any]]:
    """``(path, wrapper)`` for ``model`` (path ``""``) and every submodule compiled on its own.

    Per-block compiling (``for block in model.layers: block.compile(...)``, or assigning
    ``torch.compile(block)`` into the model) gives one wrapper per block; an
    ``OptimizedModule``'s path is its own (``layers.0``), not its ``_orig_mod``'s. A wrapper
    met twice is listed once, at its first path.
    """
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def add(path: str, obj: Any) -> None:
        wrapper = wrapper_of(obj)
        if wrapper is not None and id(wrapper) not in seen:
            seen.add(id(wrapper))
            found.append((path, wrapper))

    add("", model)
    named_modules = getattr(model, "named_modules", None)
    if callable(named_modules):
        for path, module in named_modules():
            if path:
                add(".".join(p for p in path.split(".") if p != "_orig_mod"), module)
    return found
