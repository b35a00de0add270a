"""Split a stage's backward graph into an input-gradient (I) and a weight-gradient (W) graph.

The backward graph of a stage takes ``(saved..., tangents...)`` and returns the gradients of
the stage's inputs in primal order: ``num_weight_grads`` parameter gradients first, then the
gradients of the other inputs (activations; ``None`` for inputs without one).

- I holds every node that an input gradient depends on. It takes the backward's inputs and
  returns ``(input gradients..., stash...)``, where the stash is every I value that W reads.
- W holds only the nodes that lead to parameter gradients and are not already in I (by graph
  dependency). It takes ``(stash..., the backward inputs it reads...)`` and returns the
  parameter gradients; ``BackwardSplit.w_inputs`` lists which backward inputs those are.

Running I and then W computes exactly the backward's values: each node runs once, in one of
the two graphs. Zero-bubble schedules run I as soon as the next stage needs the gradient and
delay W to fill bubbles.

``split_weight_grad`` is the Program pass (``zeroc.runtime.program``): every stage's backward
graph gets its I and W graphs (``<stage>.input_grad``, ``<stage>.weight_grad``, placed right
after the backward in the program's graphs); ``split_backward`` splits one graph.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from zeroc.passes.base import PassContext, PassResult
from zeroc.runtime.program import Program, frozen_mapping
from zeroc.runtime.torch_compat import tree_flatten


@dataclasses.dataclass(frozen=True)
class BackwardSplit:
    """The I and W graphs of one backward graph and how to call W."""

    input_grad: torch.fx.GraphModule
    weight_grad: torch.fx.GraphModule
    num_input_grads: int
    num_stash: int
    w_inputs: tuple[int, ...]
    i_nodes: int
    w_nodes: int


def _ancestors(roots: list[torch.fx.Node]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    work = list(roots)
    while work:
        node = work.pop()
        if node in seen or node.op == "placeholder":
            continue
        seen.add(node)
        work.extend(node.all_input_nodes)
    return seen


def split_backward(bw: torch.fx.GraphModule, num_weight_grads: int) -> BackwardSplit:
    """Split ``bw`` (see the module docstring) into its I and W graphs."""
    output = next(n for n in reversed(bw.graph.nodes) if n.op == "output")
    grads = list(tree_flatten(output.args[0])[0]) if isinstance(output.args[0], (tuple, list)) \
        else [output.args[0]]
    if num_weight_grads > len(grads):
        raise ValueError(f"backward returns {len(grads)} gradients, fewer than the "
                         f"{num_weight_grads} weight gradients asked for")
    weight_outs, input_outs = grads[:num_weight_grads], grads[num_weight_grads:]
    i_set = _ancestors([g for g in input_outs if isinstance(g, torch.fx.Node)])
    w_set = _ancestors([g for g in weight_outs if isinstance(g, torch.fx.Node)]) - i_set
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    stash = [n for n in bw.graph.nodes if n in i_set
             and any(u in w_set or (u.op == "output" and n in weight_outs) for u in n.users)]
    w_reads = [p for p in placeholders
               if any(u in w_set for u in p.users) or p in weight_outs]

    i_graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in bw.graph.nodes:
        if node.op == "placeholder" or node in i_set:
            env[node] = i_graph.node_copy(node, lambda n: env[n])
    i_graph.output(tuple(env[g] if isinstance(g, torch.fx.Node) else g for g in input_outs)
                   + tuple(env[n] for n in stash))

    w_graph = torch.fx.Graph()
    env = {}
    for node in stash:
        env[node] = w_graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in w_reads:
        env[node] = w_graph.node_copy(node, lambda n: env[n])
    for node in bw.graph.nodes:
        if node in w_set:
            env[node] = w_graph.node_copy(node, lambda n: env[n])
    w_graph.output(tuple(env[g] if isinstance(g, torch.fx.Node) else g for g in weight_outs))

    input_grad = torch.fx.GraphModule(bw, i_graph)
    weight_grad = torch.fx.GraphModule(bw, w_graph)
    for gm in (input_grad, weight_grad):
        gm.graph.lint()
        gm.recompile()
    return BackwardSplit(
        input_grad=input_grad,
        weight_grad=weight_grad,
        num_input_grads=len(input_outs),
        num_stash=len(stash),
        w_inputs=tuple(placeholders.index(p) for p in w_reads),
        i_nodes=len(i_set),
        w_nodes=len(w_set),
    )


def weight_grad_nodes(split: BackwardSplit) -> list[str]:
    """Names of the compute nodes of the W graph (for the plan and tests)."""
    return [n.name for n in split.weight_grad.graph.nodes
            if n.op not in ("placeholder", "output")]


def split_weight_grad(program: Program, ctx: PassContext) -> PassResult:
    """Program pass: each stage's backward -> its I and W graphs (module docstring)."""
    if program.schedule is None:  # pp = 1: autograd runs the whole backward
        return PassResult(program, False)
    splits = {}
    for stage in program.stages:
        backward = program.graphs.get(program.graph_name(stage.index, "backward"))
        if backward is None:  # an evaluation program: forward-only graphs
            continue
        splits[stage.index] = split_backward(backward, len(stage.param_inputs))
    graphs: dict[str, torch.fx.GraphModule] = {}
    for name, graph in program.graphs.items():
        graphs[name] = graph
        for index, split in splits.items():
            if name == program.graph_name(index, "backward"):
                graphs[program.graph_name(index, "input_grad")] = split.input_grad
                graphs[program.graph_name(index, "weight_grad")] = split.weight_grad
    stages = tuple(dataclasses.replace(
        stage, input_grad=splits[stage.index].input_grad,
        weight_grad=splits[stage.index].weight_grad, w_inputs=splits[stage.index].w_inputs,
        num_input_grads=splits[stage.index].num_input_grads) if stage.index in splits
        else stage for stage in program.stages)
    stats = {"stages": len(splits),
             "i_nodes": sum(s.i_nodes for s in splits.values()),
             "w_nodes": sum(s.w_nodes for s in splits.values()),
             "stash": sum(s.num_stash for s in splits.values())}
    return PassResult(dataclasses.replace(program, graphs=frozen_mapping(graphs),
                                          stages=stages), bool(splits), stats)


__all__ = ["BackwardSplit", "split_backward", "split_weight_grad", "weight_grad_nodes"]
