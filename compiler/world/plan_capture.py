"""One Dynamo trace for every pipeline position of a planned world.

``zeroc.explain(model, inputs, world=W, pp=P)`` runs one fake training step per pipeline
position (``zeroc.world.fake_world``). Every position compiles the same Dynamo graph of the same
model: only its process-group rank differs, and with it which stages it compiles and which
parameters it keeps. Dynamo's trace of a parallelized model is the slowest part of planning
a large one (about half of a Llama-7B-shaped position), so ``SharedTrace`` traces once, on the
model parallelized as rank 0 before any position is planned
(``zeroc.world.fake_world.share_front``),
and gives that graph to zeroc's pipeline compiler on every position, with the position's own
parameters and inputs in the graph's input order.

The trace is taken with a backend that keeps the graph and compiles nothing; the call that
traced stops there (``_Traced``), so no step runs twice. It is shared when it can be shared
faithfully, else each position traces the model itself:

- Dynamo made one graph of the whole forward (traced with ``fullgraph=True``; a graph
  break leaves each position to trace itself, and to report the break as a user's compile
  would). Its repeated blocks are traced once where Dynamo can reuse them
  (``zeroc.frontend.block_regions``) and inlined back into the flat graph a plain trace gives;
- its batch dimension is symbolic (``zeroc.parallelize(pp > 1)`` asks for that), so the
  pipeline compiler specializes copies of it and never changes the graph itself;
- every graph input is found on the traced model: a parameter, a buffer, a tensor
  in a module's ``__dict__`` (the flat buffers behind parallelized parameters), a tensor the
  caller passed, or a size.

The graph names the process groups it reduces over (``zeroc::unshard``'s data-parallel
group): a position gets a copy naming its own groups.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx
from torch import nn

from zeroc.frontend.block_regions import blocks_traced_once, inline_block_regions, repeated_blocks
from zeroc.frontend.config import Config
from zeroc.frontend.session import CompileSession
from zeroc.passes.base import graph_module
from zeroc.pipeline.pipeline_capture import compile_pipeline, pipeline_layout_of
from zeroc.pipeline.pipeline_front import (
    GROUP_NAMESPACES,
    SHARED_TRACE_META,
    FrontBuilt,
    front_is_shared,
    op_namespace,
    remember_sources,
)
from zeroc.runtime.world import SharedPlanning

__all__ = ["SharedTrace"]

log = logging.getLogger(__name__)

class _Traced(Exception):
    """Raised by the tracing backend once it kept the graph: the trace goes no further."""


def _stopped_by_backend(error: BaseException) -> bool:
    """Whether ``error`` is the tracing backend's ``_Traced`` (Dynamo wraps what a backend
    raises in ``BackendCompilerFailed``, keeping it as ``inner_exception``)."""
    return isinstance(error, _Traced) or isinstance(
        getattr(error, "inner_exception", None), _Traced)


def _places(model: nn.Module, args: tuple, kwargs: dict) -> dict[int, tuple]:
    """Where each tensor a graph may take as input lives, by the tensor's id."""
    where: dict[int, tuple] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, value in module._parameters.items():
            if value is not None:
                where.setdefault(id(value), ("param", path, name))
        for name, value in module._buffers.items():
            if value is not None:
                where.setdefault(id(value), ("buffer", path, name))
        for name, value in module.__dict__.items():
            if isinstance(value, torch.Tensor):
                where.setdefault(id(value), ("attr", path, name))
    for index, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            where.setdefault(id(value), ("arg", index))
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            where.setdefault(id(value), ("kwarg", name))
    return where


def _find(place: tuple, model: nn.Module, args: tuple, kwargs: dict) -> Any:
    kind = place[0]
    if kind == "arg":
        return args[place[1]]
    if kind == "kwarg":
        return kwargs[place[1]]
    module = model.get_submodule(place[1])
    if kind == "param":
        return module._parameters[place[2]]
    if kind == "buffer":
        return module._buffers[place[2]]
    return module.__dict__[place[2]]


def _group_names(example_inputs: list[Any]) -> tuple[str, str]:
    layout = pipeline_layout_of(example_inputs)
    return (layout.mesh.dp_group_name, layout.mesh.pp_group_name) if layout else ("", "")


def _renamed_groups(gm: torch.fx.GraphModule, names: dict[str, str]) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose collective ops name the groups ``names`` maps to."""
    names = {old: new for old, new in names.items() if old and old != new}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        copied = graph.node_copy(node, lambda n: env[n])
        if op_namespace(node.target) in GROUP_NAMESPACES:
            copied.args = tuple(names.get(a, a) if isinstance(a, str) else a
                                for a in copied.args)
            copied.kwargs = {k: names.get(v, v) if isinstance(v, str) else v
                             for k, v in copied.kwargs.items()}
        env[node] = copied
    return graph_module(gm, graph)


@contextlib.contextmanager
def _without_forward_depth_hooks(model: nn.Module) -> Iterator[None]:
    """Take ``zeroc.sharding.sharded_params``' forward-depth hooks off every module while Dynamo
    traces: they do nothing when compiling and add no node to the graph, but Dynamo inlines
    two per module (15% of a Llama trace). Every hook dict is put back as it was."""
    from zeroc.sharding.sharded_params import FORWARD_DEPTH_HOOKS

    saved = []
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            if any(h in FORWARD_DEPTH_HOOKS for h in hooks.values()):
                saved.append((hooks, list(hooks.items())))
                for key in [k for k, h in hooks.items() if h in FORWARD_DEPTH_HOOKS]:
                    del hooks[key]
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.clear()
            hooks.update(items)


class SharedTrace:
    """Dynamo's graph of a model, traced on the first pipeline position, compiled on each."""

    def __init__(self, shared: SharedPlanning | None = None) -> None:
        # the holder of the world whose positions share this trace (None: one position)
        self.shared = shared
        self.gm: torch.fx.GraphModule | None = None
        self.places: list[tuple] | None = None
        self.example_inputs: list[Any] = []  # the traced call's (sizes are SymInts)
        self.sizes: dict[int, int] = {}  # graph input -> the size the traced call passed
        self.graphs = 0
        self.reusable = False
        self.attempted = False  # trace() ran (whether or not it gave a reusable graph)

    def _backend(self, model: nn.Module, args: tuple, kwargs: dict
                 ) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]:
        def keep(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            self.graphs += 1
            inlined = inline_block_regions(gm, model)  # the graph a trace without regions gives
            if inlined:
                log.debug("zeroc: shared trace: %d block calls traced as regions", inlined)
            self.gm, self.example_inputs = gm, list(example_inputs)
            where = _places(model, args, kwargs)
            places: list[tuple] | None = []
            for index, value in enumerate(example_inputs):
                if isinstance(value, torch.SymInt):
                    places.append(("size", index))
                elif isinstance(value, torch.Tensor) and id(value) in where:
                    places.append(where[id(value)])
                else:
                    places = None
                    break
            self.places = places
            remember_sources(gm)  # Dynamo drops the inputs' sources once this returns
            for index, value in enumerate(example_inputs):
                if isinstance(value, torch.SymInt):
                    self.sizes[index] = int(value.node.hint)  # the traced call's size
            # Stop here: Dynamo then builds no guards for a frame that never runs again.
            raise _Traced

        return keep

    def _trace_once(self, model: nn.Module, args: tuple, kwargs: dict, regions: bool) -> bool:
        """One Dynamo trace, with the repeated blocks as nested compile regions or not;
        False when it failed."""
        self.graphs = 0
        # fullgraph: a graph break raises here (and the positions trace as a user's compile
        # would, which says where the break is) instead of leaving a tail this graph lacks.
        traced = torch.compile(model, backend=self._backend(model, args, kwargs),
                               fullgraph=True)
        marking = blocks_traced_once(model) if regions else contextlib.nullcontext(0)
        try:
            with _without_forward_depth_hooks(model), marking:
                traced(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 (any failure: trace per position instead)
            if _stopped_by_backend(error):
                return True  # the backend kept the graph and stopped the trace, as intended
            log.debug("zeroc: shared trace%s failed (%s)", " with block regions" if regions
                      else "", str(error).splitlines()[0] if str(error) else type(error).__name__)
            self.graphs = 0
            return False
        else:
            self.graphs = 2  # the forward ran to its end without reaching the graph
        finally:
            torch.compiler.reset()  # a position's own compile must not find this trace's frame
        return True

    def trace(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        """Trace ``model`` (parallelized, on this position's fake tensors) with Dynamo: its
        repeated blocks once (``zeroc.frontend.block_regions``) where Dynamo can, else block by
        block; when neither gives one graph, each position traces the model itself."""
        self.attempted = True
        if not (repeated_blocks(model) and self._trace_once(model, args, kwargs, True)):
            self._trace_once(model, args, kwargs, False)
        self.reusable = (self.graphs == 1 and self.places is not None
                         and any(p[0] == "size" for p in self.places))
        log.debug("zeroc: shared trace: %d graph(s), %s", self.graphs,
                  "reused by every position" if self.reusable else "not reusable")

    def compile(self, model: nn.Module, args: tuple, kwargs: dict, options: dict | None
                ) -> tuple[Callable[..., torch.Tensor], CompileSession]:
        """This position's pipelined step of the traced graph and the session recording it:
        ``step(*args, **kwargs)`` runs it and returns the loss."""
        assert self.gm is not None and self.places is not None
        inputs = [self.example_inputs[p[1]] if p[0] == "size" else _find(p, model, args, kwargs)
                  for p in self.places]
        groups = dict(zip(_group_names(self.example_inputs), _group_names(inputs), strict=True))
        if front_is_shared(self.gm, self.shared) or all(old == new for old, new in groups.items()):
            gm = self.gm  # the kept front is renamed instead; or the names are this position's
        else:
            gm = _renamed_groups(self.gm, groups)
            gm.meta[SHARED_TRACE_META] = self.gm  # positions find the front they share by it
        from zeroc.frontend.backend import _with_tuned_options, check_layout_options

        config = Config.build(None, _with_tuned_options(inputs, options))
        check_layout_options(inputs, config)
        session = CompileSession(config)
        compiled = compile_pipeline(gm, inputs, config, session, pipeline_layout_of(inputs))

        def step(*call_args: Any, **call_kwargs: Any) -> torch.Tensor:
            flat = [self.sizes[p[1]] if p[0] == "size" else _find(p, model, call_args, call_kwargs)
                    for p in self.places]
            outs = compiled(*flat)
            return next(v for v in outs if isinstance(v, torch.Tensor) and not v.is_meta)

        return step, session

    def build_front(self, model: nn.Module, args: tuple, kwargs: dict,
                    options: dict | None) -> None:
        """Build (and keep in ``self.shared``) the pipeline front every position compiles
        from, compiling no stage: the call stops once the front is made. The model must be
        parallelized for this world (``planned_world`` with ``shared=self.shared``)."""
        if self.shared is None:
            raise ValueError("SharedTrace.build_front needs the planned world's SharedPlanning")
        step, _ = self.compile(model, args, kwargs, options)
        self.shared.front_only = True
        try:
            step(*args, **kwargs)
        except FrontBuilt:
            pass  # the intended stop: the front is kept, no stage was compiled
        finally:
            self.shared.front_only = False
