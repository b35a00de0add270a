"""The F&B graph: one stage's forward and another's backward interleaved in one graph.

DualPipe's overlapped action runs the forward of micro-batch ``i`` and the backward of
micro-batch ``j`` at once, so the communication of one hides behind the compute of the other.
The reference leaves that to a hand-written ``overlapped_forward_backward`` per model; here it is
a graph transform. The two graphs are independent, so any interleaving of their nodes that
keeps each graph's own order is valid. ``interleave`` merges them by progress: the next node
comes from whichever graph has done the smaller fraction of its estimated work (FLOPs plus
bytes), except that a collective's wait (a ZeRO gather, a gradient reduce-scatter: an issue
op and ``wait_tensor``) is never placed before the other graph has placed a compute node
since the issue, while it has nodes left: every collective of one graph has the other
graph's compute between its issue and its wait.

The merged graph takes ``(forward args..., backward args...)`` and returns
``(forward outputs..., backward outputs...)``; ``num_forward_outputs`` says where they split.

``overlap_fb`` is the Program pass (``zeroc.runtime.program``): with ``pp_reshard=True`` (the
ZeRO gathers and reductions inside the stage graphs) every overlapped action of this rank's
schedule gets its F&B graph once (``<stage>.fb<backward stage>`` in the program's graphs, and
in the forward stage's ``overlapped``). Without collectives in the graphs a merged graph
overlaps nothing on one stream: ``zeroc.passes.program.comm_lowering`` then lowers ``FB`` as ``F``,
its sends, ``B``, so the forward chunk's transfers are in flight while the backward chunk
computes, and this pass makes no graph.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from zeroc.passes.base import PassContext, PassResult
from zeroc.runtime.actions import ActionKind
from zeroc.runtime.collectives import ISSUE_OPS, WAIT_OP
from zeroc.runtime.cost.cost import node_cost
from zeroc.runtime.program import Program, frozen_mapping
from zeroc.runtime.torch_compat import tree_flatten


def _outputs(gm: torch.fx.GraphModule) -> list[Any]:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    value = output.args[0]
    return list(tree_flatten(value)[0]) if isinstance(value, (tuple, list)) else [value]


def _work(node: torch.fx.Node) -> float:
    cost = node_cost(node)
    return float(cost.flops + cost.bytes) + 1.0


def _attribute(gm: torch.nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _waits_too_early(node: torch.fx.Node, issued_at: dict[torch.fx.Node, int],
                     other_computed: int) -> bool:
    """Whether ``node`` waits for a collective of its side issued since the other side last
    placed a compute node (so nothing would run between the issue and the wait)."""
    if node.op != "call_function" or node.target is not WAIT_OP:
        return False
    issue = node.args[0]
    if isinstance(issue, torch.fx.Node) and issue.target is operator.getitem:
        issue = issue.args[0]  # one output of a coalesced collective
    return issue in issued_at and issued_at[issue] == other_computed


def interleave(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule
               ) -> torch.fx.GraphModule:
    """One graph running ``forward`` and ``backward`` side by side (module docstring)."""
    graph = torch.fx.Graph()
    root = torch.nn.Module()
    envs: list[dict[torch.fx.Node, torch.fx.Node]] = [{}, {}]
    sources = (forward, backward)
    for prefix, env, source in zip(("f", "b"), envs, sources, strict=True):
        for node in source.graph.nodes:
            if node.op == "placeholder":
                env[node] = graph.placeholder(f"{prefix}_{node.name}")
                env[node].meta = dict(node.meta)
    bodies = [[n for n in s.graph.nodes if n.op not in ("placeholder", "output")]
              for s in sources]
    totals = [sum(_work(n) for n in body) or 1.0 for body in bodies]
    done = [0.0, 0.0]
    positions = [0, 0]
    computed = [0, 0]  # compute nodes placed per side
    # A collective issued by one side: how many of the other side's compute nodes had been
    # placed when it was issued. Its wait is placed only after at least one more (while the
    # other side has nodes left), so every collective has the other side's compute to hide
    # behind, whatever the progress fractions say.
    issued_at: dict[torch.fx.Node, int] = {}
    while positions[0] < len(bodies[0]) or positions[1] < len(bodies[1]):
        if positions[1] >= len(bodies[1]):
            side = 0
        elif positions[0] >= len(bodies[0]):
            side = 1
        else:
            side = 0 if done[0] / totals[0] <= done[1] / totals[1] else 1
            if _waits_too_early(bodies[side][positions[side]], issued_at, computed[1 - side]):
                side = 1 - side
        node = bodies[side][positions[side]]
        if node.op == "call_function" and node.target in ISSUE_OPS:
            issued_at[node] = computed[1 - side]
        elif node.op == "call_function" and node.target not in (WAIT_OP, operator.getitem):
            computed[side] += 1
        env = envs[side]
        if node.op == "get_attr":
            name = f"side{side}_{node.target.replace('.', '_')}"
            setattr(root, name, _attribute(sources[side], node.target))
            env[node] = graph.get_attr(name)
            env[node].meta = dict(node.meta)
        else:
            env[node] = graph.node_copy(node, lambda n, env=env: env[n])
        done[side] += _work(node)
        positions[side] += 1
    results = []
    for env, source in zip(envs, sources, strict=True):
        results.extend(env[v] if isinstance(v, torch.fx.Node) else v for v in _outputs(source))
    graph.output(tuple(results))
    merged = torch.fx.GraphModule(root, graph)
    merged.graph.lint()
    merged.recompile()
    return merged


class OverlappedGraph:
    """A callable F&B graph with the count of its forward outputs.

    ``gm`` is the merged ``GraphModule`` or what runs it (its Inductor-compiled form)."""

    def __init__(self, gm: Callable[..., Any], num_forward_outputs: int) -> None:
        self.gm = gm
        self.num_forward_outputs = num_forward_outputs

    def __call__(self, *args: Any) -> Any:
        return self.gm(*args)


def overlap_fb(program: Program, ctx: PassContext) -> PassResult:
    """Program pass: the F&B graph of every overlapped action this rank runs (module
    docstring), built once per (forward stage, backward stage)."""
    if program.schedule is None or program.pipeline is None:  # pp = 1: nothing overlaps
        return PassResult(program, False)
    if not ctx.config.pp_reshard:  # comm_lowering runs FB as F, its sends, B
        return PassResult(program, False, {"skipped": "pp_reshard=False: no communication "
                                           "inside the stage graphs to overlap"})
    pairs = dict.fromkeys((a.stage, a.b_stage)
                          for a in program.schedule.actions[program.pipeline.position]
                          if a.kind is ActionKind.FB)
    stages = program.stage_map()
    graphs = dict(program.graphs)
    overlapped: dict[int, dict[int, OverlappedGraph]] = {}
    for f_stage, b_stage in pairs:
        if b_stage in stages[f_stage].overlapped or stages[b_stage].backward is None:
            continue  # made already, or an evaluation program (forward-only graphs)
        forward = graphs[program.graph_name(f_stage, "forward")]
        merged = interleave(forward, graphs[program.graph_name(b_stage, "backward")])
        graphs[program.graph_name(f_stage, f"fb{b_stage}")] = merged
        overlapped.setdefault(f_stage, dict(stages[f_stage].overlapped))[b_stage] = (
            OverlappedGraph(merged, len(_outputs(forward))))
    if not overlapped:
        return PassResult(program, False)
    new_stages = tuple(
        dataclasses.replace(s, overlapped=frozen_mapping(overlapped[s.index]))
        if s.index in overlapped else s for s in program.stages)
    return PassResult(dataclasses.replace(program, graphs=frozen_mapping(graphs),
                                          stages=new_stages), True,
                      {"fb_graphs": sum(len(v) for v in overlapped.values())})
