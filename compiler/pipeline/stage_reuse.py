"""Stages that run the same program are compiled once while a world is planned.

A Llama-shaped model cut into 8 stages of 4 blocks has 6 middle stages whose graphs differ
only in which parameters and messages they read: the same ops on the same shapes in the same
order. ``zeroc.explain(model, inputs, world=...)`` compiles every position's stages in one
process; compiling such a stage (AOTAutograd's joint graph, the passes, the partition, the
I/W split) takes seconds each time and gives the same graphs. So, while a world is planned
(a ``SharedPlanning`` holder is given: ``PlannedWorld.shared`` on the layout), a compiled
stage is kept under its ``signature`` and a later stage of the same signature takes its
graphs, with its own index, inputs and message keys;
the plan's records of the graphs (graphs, passes, kernels, collectives) are copied under the
new stage's names.

The signature is the stage graph's structure: every node's op, target and arguments (nodes by
position, constants by value, a ``get_attr`` by its tensor's shape and dtype), and each
example argument's shape, stride, dtype and whether it requires a gradient. Two stages of
one signature trace to the same joint graph, so the compiled graphs are those the stage
would get. A compiled training job never reuses: each rank compiles its own stages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx

from zeroc.frontend.session import CompiledGraph
from zeroc.passes.front.split_stages import StageSplit
from zeroc.runtime.program import StageProgram
from zeroc.runtime.world import SharedPlanning

__all__ = ["StageTemplate", "counts", "find", "keep", "signature", "structure"]


def _argument(value: Any, index: dict[torch.fx.Node, int]) -> Any:
    if isinstance(value, torch.fx.Node):
        return ("node", index[value])
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_argument(v, index) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _argument(v, index)) for k, v in value.items()))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    return repr(value)


def _tensor_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), str(value.dtype), str(value.device),
                value.requires_grad)
    return repr(value)


def structure(split: StageSplit, index: int) -> tuple[Any, ...]:
    """Stage ``index``'s graph as a value: every node's op, target and arguments (nodes by
    position, constants by value, a ``get_attr`` by its tensor's shape and dtype)."""
    gm = split.stages[index].gm
    positions: dict[torch.fx.Node, int] = {}
    nodes = []
    for node in gm.graph.nodes:
        positions[node] = len(positions)
        if node.op in ("placeholder", "output"):  # a placeholder's name is its source's
            target: Any = ""
        elif node.op == "get_attr":
            target = _tensor_key(getattr(gm, node.target, None))
        elif node.op == "call_module":
            target = ("module", node.target)  # its own weights: shared by no other stage
        else:
            target = node.target if isinstance(node.target, str) else str(node.target)
        nodes.append((node.op, target, _argument(node.args, positions),
                      _argument(node.kwargs, positions)))
    return tuple(nodes)


def signature(split: StageSplit, index: int, args: list[Any]) -> tuple[Any, ...]:
    """What two stages must share to compile to the same graphs (see the module docstring)."""
    spec = split.stages[index]
    return (structure(split, index), tuple(_tensor_key(a) for a in args),
            len(spec.param_inputs), len(spec.local_inputs), len(spec.in_keys),
            len(spec.out_keys), spec.num_model_outputs, tuple(spec.output_requires_grad))


@dataclasses.dataclass(frozen=True)
class StageTemplate:
    """A compiled stage and the records its compile added, for stages of its signature."""

    program: StageProgram
    prefix: str
    graphs: tuple[Any, ...]
    passes: tuple[Any, ...]
    kernels: tuple[Any, ...]
    collectives: tuple[Any, ...]
    saved_bytes: int


def counts(record: CompiledGraph) -> tuple[int, int, int, int, int]:
    """How far ``record``'s lists reach (and its saved bytes), before a stage compiles."""
    return (len(record.graphs), len(record.passes), len(record.kernels),
            len(record.collectives), record.saved_bytes)


def keep(key: tuple[Any, ...] | None, program: StageProgram, record: CompiledGraph,
         before: tuple[int, int, int, int, int], shared: SharedPlanning | None) -> None:
    """Keep ``program`` (compiled into ``record`` since ``before = counts(record)``) for
    later stages of signature ``key`` in ``shared``, the holder of the world planned."""
    if shared is None or key is None or key in shared.stages:
        return
    graphs, passes, kernels, collectives, saved = before
    if len(record.collectives) > collectives:  # a stage graph with a collective: not shared
        return
    shared.stages[key] = StageTemplate(
        program=program, prefix=f"{record.prefix}.s{program.index}.",
        graphs=tuple(record.graphs[graphs:]), passes=tuple(record.passes[passes:]),
        kernels=tuple(record.kernels[kernels:]), collectives=(),
        saved_bytes=record.saved_bytes - saved)



def _renamed(info: Any, old: str, new: str) -> Any:
    changes = {field: getattr(info, field).replace(old, new, 1)
               for field in ("name", "graph") if isinstance(getattr(info, field, None), str)
               and getattr(info, field).startswith(old)}
    return dataclasses.replace(info, **changes) if changes else info


def find(key: tuple[Any, ...] | None, split: StageSplit, index: int, record: CompiledGraph,
         inference: Any, shared: SharedPlanning | None) -> StageProgram | None:
    """Stage ``index``'s program from a stage of the same signature kept in ``shared`` (its
    records added to ``record`` under the stage's names), or None if there is none."""
    template = None if shared is None or key is None else shared.stages.get(key)
    if template is None:
        return None
    spec = split.stages[index]
    new = f"{record.prefix}.s{index}."
    record.graphs.extend(_renamed(g, template.prefix, new) for g in template.graphs)
    record.passes.extend(_renamed(p, template.prefix, new) for p in template.passes)
    record.kernels.extend(_renamed(k, template.prefix, new) for k in template.kernels)
    record.saved_bytes += template.saved_bytes
    return dataclasses.replace(
        template.program, index=index, param_inputs=spec.param_inputs,
        local_inputs=spec.local_inputs, in_keys=spec.in_keys, out_keys=spec.out_keys,
        num_model_outputs=spec.num_model_outputs, inference=inference)
