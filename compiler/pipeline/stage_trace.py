"""Pipeline stages are traced on fake tensors of a mode of their own: nothing on the device.

AOTAutograd traces each stage graph on example arguments: its joint graph when the pipeline
compiles and, on the first ``torch.no_grad()`` call, its forward-only graph. With ZeRO's
gathers hoisted out of the stage graphs (``passes/front/hoist_unshard.py``) a stage reads its
parameters whole, so the arguments have the full parameters' shapes. Made as tensors on the
rank's device they would be real memory (a CUDA allocation is memory, whether its pages are
touched or not): every full parameter of the rank's stages next to its shards while the
pipeline compiles, and for as long as a forward-only graph kept its arguments.

So a pipeline compile makes a ``StageTrace``: a ``FakeTensorMode`` of its own and, for the
inputs this rank's stages read, fake tensors of that mode with the shapes, strides, dtypes,
devices and gradient flags the stage graphs see (a hoisted parameter: its full shape, in
its gather's dtype). Tensors of that mode carry metadata only. Everything that traces a
stage graph or passes over it runs inside ``StageTrace.tracing()``: no fake mode from around
the compile (a planned world's, whose tensors stand for device memory: ``zeroc.world.fake_world``)
and no tracing context (Dynamo's, when a static graph's pipeline compiles inside the
backend call), so AOTAutograd takes the stage's own mode from its arguments (it traces
with that mode active: what the graph makes itself, a factory's output, is fake too), and
the graph passes that add nodes give them values in that mode (``detect_fake_mode`` on the
graph's values).

``LazyInference`` keeps a stage's graph and its fake arguments, never a device tensor,
until its first call.

Effect tokens. An op with a side effect (``torch.linalg.cholesky``'s error check,
``aten._linalg_check_errors``; a print; an effectful custom op) is traced by AOTAutograd as
``with_effects(token, op, ...)``, and ``aot_export_joint_simple`` hands the tokens over as
extra leading inputs and outputs of its graph: a calling convention the stage's arguments do
not follow. (At pp = 1 AOTAutograd's runtime wrapper passes and drops them.) ``export_stage``
puts them inside the graph, as torch's own ``unlift_effect_tokens`` does: each input token
becomes a ``prims._make_token()`` node, and each output token goes to one
``prims._sink_tokens`` (effectful, so no dead-code pass drops the op) in the graph that runs the
effect: the inference graph at once, the forward graph once the joint is partitioned (the
partition keeps the tokens as forward outputs, so the effect stays in the forward;
``sink_output_tokens``). A stage whose graphs still do not take exactly its arguments is
refused, naming the effectful ops (``check_calling_convention``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.fx
from torch import nn

from zeroc.runtime.pipeline.zero import HoistedParam
from zeroc.runtime.torch_compat import (
    FakeTensorMode,
    aot_export_joint_simple,
    tracing,
    unset_fake_temporarily,
)

__all__ = ["LazyInference", "StageTrace", "check_calling_convention", "export_stage",
           "full_size_fakes", "sink_output_tokens"]

log = logging.getLogger(__name__)

# Effect tokens (see the module docstring): the higher-order op that threads them, and the
# ops that make one and consume the last ones inside a graph.
EFFECTS = torch.ops.higher_order.with_effects
MAKE_TOKEN = torch.ops.prims._make_token.default
SINK_TOKENS = torch.ops.prims._sink_tokens.default


class StageTrace:
    """The fake tensors a pipeline's stage graphs are traced on (see the module docstring).

    ``inputs[i]`` stands for the compiled graph's input ``i`` where a stage of this rank
    reads it (``None`` elsewhere): a hoisted parameter as the full parameter, anything else
    as it is."""

    def __init__(self, inputs: list[Any], hoisted: dict[int, HoistedParam],
                 needed: Iterable[int]) -> None:
        self.mode = FakeTensorMode(allow_non_fake_inputs=False)
        self.inputs: list[Any] = [None] * len(inputs)
        with self.tracing(), self.mode:
            for index in sorted(set(needed)):
                value = inputs[index]
                spec = hoisted.get(index)
                if spec is not None:
                    self.inputs[index] = _full_parameter(value, spec)
                elif isinstance(value, torch.Tensor):
                    self.inputs[index] = self.mode.from_tensor(value, static_shapes=True)
                else:
                    self.inputs[index] = value

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """No ambient fake mode and no Dynamo tracing context (see the module docstring)."""
        with tracing(None), unset_fake_temporarily():
            yield

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: Any,
              requires_grad: bool) -> torch.Tensor:
        """A fake message of this trace (a stage's input from the stage before it)."""
        with self.tracing(), self.mode:
            return torch.zeros(shape, dtype=dtype, device=device).requires_grad_(requires_grad)


def _full_parameter(shard: torch.Tensor, spec: HoistedParam) -> nn.Parameter:
    """A parameter of ``spec``'s full shape and gather dtype, like ``shard`` otherwise (made
    in the active mode)."""
    full = torch.empty(spec.shape, dtype=spec.param_dtype or shard.dtype, device=shard.device)
    return nn.Parameter(full, requires_grad=shard.requires_grad)


def full_size_fakes(inputs: list[Any], hoisted: dict[int, HoistedParam]) -> list[Any]:
    """``inputs`` with each hoisted parameter replaced by a fake full-size one (a mode of its
    own: metadata only), for passes that read shapes (the micro-batch graph)."""
    out = list(inputs)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with tracing(None), unset_fake_temporarily(), mode:
        for index, spec in hoisted.items():
            out[index] = _full_parameter(inputs[index], spec)
    return out


class LazyInference:
    """A stage's forward-only graph, traced and compiled on its first ``no_grad`` call.

    Traced without the joint: nothing is saved for a backward, and the fused loss computes no
    head gradients (``need_grad=False``). It keeps the stage's fake arguments (``trace``'s
    mode: no memory) until then."""

    def __init__(self, stage_gm: torch.fx.GraphModule, args: list[Any], trace: StageTrace,
                 compile_graph: Callable[[torch.fx.GraphModule], Callable[..., Any]],
                 decompositions: dict[Any, Any] | None = None) -> None:
        self.stage_gm = stage_gm
        self.decompositions = decompositions
        self.trace = trace
        with trace.tracing():
            self.args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        self.compile_graph = compile_graph
        self.graph: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.graph is None:
            self.compile()
        return self.graph(*args)  # type: ignore[misc]

    def compile(self) -> None:
        """Trace and compile the graph now (an evaluation graph's stages: before the first
        call); nothing if it is compiled."""
        if self.graph is None:
            gm = torch.fx.GraphModule(self.stage_gm, copy.deepcopy(self.stage_gm.graph))
            for node in gm.graph.nodes:
                if node.target is torch.ops.zeroc.linear_cross_entropy.default:
                    node.args = (*node.args[:7], False)
            gm.recompile()
            with self.trace.tracing():
                with torch.no_grad(), self.trace.mode:
                    traced, tokens = export_stage(gm, self.args, trace_joint=False,
                                                  decompositions=self.decompositions)
                    sink_output_tokens(traced, tokens)
                self.graph = self.compile_graph(traced)
            log.debug("zeroc: traced a stage's forward-only graph on its first no_grad call")
            self.stage_gm = self.args = self.trace = None  # type: ignore[assignment]


def export_stage(gm: torch.fx.GraphModule, args: list[Any], *, trace_joint: bool,
                 decompositions: dict[Any, Any] | None = None
                 ) -> tuple[torch.fx.GraphModule, int]:
    """``aot_export_joint_simple`` of a stage graph on ``args``, its input effect tokens made
    inside the graph (see the module docstring); returns the graph and how many tokens it
    has. The graph's outputs still start with the tokens: ``sink_output_tokens`` takes them
    out of the graph that runs the effect."""
    graph = aot_export_joint_simple(gm, args, trace_joint=trace_joint,
                                    decompositions=decompositions)
    primals = [n for n in graph.graph.find_nodes(op="placeholder")
               if not n.name.startswith("tangents")]
    tokens = len(primals) - len(args)
    if tokens <= 0:
        return graph, 0
    first = next(n for n in graph.graph.nodes if n.op != "placeholder")
    for token in primals[:tokens]:
        if any(u.target is not EFFECTS and u.op != "output" for u in token.users):
            check_calling_convention(graph, len(args), None, "stage")  # raises, naming ops
        with graph.graph.inserting_before(first):
            made = graph.graph.call_function(MAKE_TOKEN, ())
        made.meta.update(token.meta)
        token.replace_all_uses_with(made)
        graph.graph.erase_node(token)
    graph.recompile()
    log.debug("zeroc: a stage graph threads %d effect token(s) through %s", tokens,
              effectful_ops(graph))
    return graph, tokens


def sink_output_tokens(graph: torch.fx.GraphModule, tokens: int) -> None:
    """Take ``graph``'s first ``tokens`` outputs (effect tokens) into a ``_sink_tokens``."""
    if not tokens:
        return
    output = next(iter(graph.graph.find_nodes(op="output")))
    outs = list(output.args[0])
    with graph.graph.inserting_before(output):
        graph.graph.call_function(SINK_TOKENS, (outs[:tokens],))
    output.args = (type(output.args[0])(outs[tokens:]),)
    graph.recompile()


def effectful_ops(graph: torch.fx.GraphModule) -> str:
    """The ops ``graph`` runs for their effect (through ``with_effects``), for messages."""
    ops = sorted({str(n.args[1]) for n in graph.graph.find_nodes(op="call_function",
                                                                target=EFFECTS)})
    return ", ".join(ops) or "no effectful op"


def check_calling_convention(graph: torch.fx.GraphModule, inputs: int, outputs: int | None,
                             what: str) -> None:
    """Raise naming the effectful ops when ``graph`` does not take ``inputs`` arguments (and,
    where ``outputs`` is given, return at least that many values): the executor calls it
    with the stage's own arguments."""
    taken = len(graph.graph.find_nodes(op="placeholder"))
    output = next(iter(graph.graph.find_nodes(op="output")))
    returned = len(output.args[0])
    if taken == inputs and (outputs is None or returned >= outputs):
        return
    raise ValueError(
        f"zeroc pipeline: the {what} graph takes {taken} inputs and returns {returned} "
        f"values where the stage passes {inputs}"
        + (f" and reads {outputs}" if outputs is not None else "")
        + f"; its effectful ops ({effectful_ops(graph)}) thread state through the graph "
        "that a pipeline stage cannot pass. Compile this model with pp=1, or move the op "
        "out of the model's forward")
