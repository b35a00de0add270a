"""Every parameter eager would give a gradient gets one: a compile-time check.

A compiled program can lose a parameter's gradient without changing any value the user
sees: a pass drops an in-place write whose result nothing reads (``out.add_(bias[ids])``,
while the bias is still zero), a stage split leaves a read behind, a partition cuts a path.
The loss stays right, the parameter's ``.grad`` stays ``None``, and the optimizer silently
trains every other parameter away from eager. This module makes that class of bug loud.

The reference is what eager autograd would do, read from Dynamo itself: Dynamo runs the
user's code on fake tensors with autograd on, so each output's ``example_value`` carries the
autograd graph the real call would build. Walking it from the outputs (``grad_fn`` ->
``next_functions``) to its ``AccumulateGrad`` leaves gives exactly the graph inputs eager's
``backward()`` would give a ``.grad`` (a parameter read only under ``no_grad``, through
``detach``, or by an integer op is not among them, as eager leaves it ``None``). The walk
touches no tensor data and happens before any zeroc pass, so no pass can hide a read.

``check_covered`` then compares that set with the gradients the compiled backward graphs
return, and raises ``MissingGradientError`` naming the parameter and the graph or stage, for
a gradient missing and for one eager would not compute (a ``no_grad`` region lost).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.fx

from zeroc.runtime.torch_compat import tree_flatten

__all__ = ["MissingGradientError", "check_covered", "check_stages", "differentiated_inputs",
           "graph_gradients"]


class MissingGradientError(RuntimeError):
    """The compiled program gives a parameter no gradient where eager gives one, or one
    where eager gives none."""


def _example(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def differentiated_inputs(gm: torch.fx.GraphModule,
                          outputs: Iterable[int] | None = None) -> frozenset[int] | None:
    """Indices of ``gm``'s placeholders that eager's backward from its outputs reaches.

    ``outputs``: positions among the flattened outputs to start from (default: every output
    that requires a gradient). ``None`` when no output requires a gradient (traced under
    ``no_grad``: there is no reference) or the graph's autograd metadata is not its own:
    none left (a graph built by hand, or released), or a walk that reaches a leaf that is not
    one of its placeholders (a copy whose values were traced elsewhere, as a planned world's
    inlined block regions are): nothing is checked then.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index_of = {id(v): i for i, n in enumerate(placeholders)
                if isinstance(v := _example(n), torch.Tensor)}
    if not index_of:
        return None
    output = next(n for n in gm.graph.nodes if n.op == "output")
    flat, _ = tree_flatten(output.args[0])
    chosen = range(len(flat)) if outputs is None else outputs
    roots = [_example(flat[i]) for i in chosen]
    if any(isinstance(flat[i], torch.fx.Node) and r is None for i, r in zip(chosen, roots,
                                                                             strict=True)):
        return None
    if not any(isinstance(r, torch.Tensor) and r.requires_grad for r in roots):
        return None  # traced under no_grad (a pipeline still compiles its training graphs)
    stack = [r.grad_fn for r in roots if isinstance(r, torch.Tensor) and r.grad_fn is not None]
    seen: set[int] = set()
    reached: set[int] = set()
    while stack:
        function = stack.pop()
        if function is None or id(function) in seen:
            continue
        seen.add(id(function))
        variable = getattr(function, "variable", None)  # an AccumulateGrad node: a leaf
        if variable is not None:
            if id(variable) not in index_of:
                return None
            reached.add(index_of[id(variable)])
        stack.extend(next_function for next_function, _ in function.next_functions)
    return frozenset(reached)


def graph_gradients(backward: torch.fx.GraphModule, count: int) -> list[bool]:
    """Whether each of the first ``count`` outputs of a backward graph is a gradient (not
    ``None``): the gradients of its first ``count`` differentiable inputs."""
    output = next(n for n in reversed(backward.graph.nodes) if n.op == "output")
    values = output.args[0]
    values = values if isinstance(values, (tuple, list)) else (values,)
    return [v is not None for v in values[:count]]


def check_covered(expected: frozenset[int] | None, produced: Mapping[int, bool | None],
                  names: Mapping[int, str], where: Mapping[int, str]) -> None:
    """Raise ``MissingGradientError`` unless the compiled backward returns a gradient for
    exactly the trainable inputs eager's backward reaches.

    ``expected``: from ``differentiated_inputs`` (``None``: nothing to check);
    ``produced``: input index -> whether the compiled backward returns its gradient (``None``:
    not known here, e.g. another rank's stage; an index absent from it is read by no compiled
    graph); ``names``: the trainable parameters' readable names (only these are checked);
    ``where``: the graph or stage each index belongs to, for the message.
    """
    if expected is None:
        return
    missing = sorted(i for i in names if i in expected and produced.get(i, False) is False)
    extra = sorted(i for i in names if i not in expected and produced.get(i) is True)
    if not missing and not extra:
        return
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} parameter(s) that eager autograd would give a gradient get none: "
            + "; ".join(f"{names[i]} ({where.get(i, 'read by no compiled graph')})"
                        for i in missing))
    if extra:
        problems.append(
            f"{len(extra)} parameter(s) that eager autograd would leave without a gradient "
            "(read only under no_grad, through detach or integer ops) get one: "
            + "; ".join(f"{names[i]} ({where.get(i, 'no graph')})" for i in extra))
    raise MissingGradientError(
        f"zeroc: the compiled program's gradients differ from eager's: {'. '.join(problems)}. "
        "This is a zeroc bug (a pass dropped a read, a gradient path or a grad-mode switch); "
        "training on would silently diverge from eager. Please report it with the model; "
        "TORCH_LOGS=+zeroc shows the passes")


def check_stages(stages: Iterable[Any], programs: Mapping[int, Any],
                 expected: frozenset[int] | None, trainable: Mapping[int, str]) -> frozenset[int]:
    """``check_covered`` for a pipeline: every trainable parameter eager's backward reaches is
    read by some stage, and the stages of this rank that alone read one return its gradient.

    ``stages``: every stage's spec (``index``, ``param_inputs``), the same on every rank;
    ``programs``: this rank's compiled stages by index (``backward`` graph, ``param_inputs``);
    ``trainable``: parameter input index -> name. A parameter another rank's stage also reads
    is checked there. Returns the parameters only this rank's stages read and whose gradient
    none of them returns (eager leaves them ``None``: the step gives them none either).
    """
    readers: dict[int, list[int]] = {}
    for spec in stages:
        for i in spec.param_inputs:
            readers.setdefault(i, []).append(spec.index)
    produced: dict[int, bool | None] = {}
    for i, indices in readers.items():
        local = [programs[s] for s in indices if s in programs]
        if len(local) < len(indices) or not all(
                isinstance(p.backward, torch.fx.GraphModule) for p in local):
            produced[i] = None  # another rank's stage reads it too: not known here
            continue
        produced[i] = any(graph_gradients(p.backward, len(p.param_inputs))[
            p.param_inputs.index(i)] for p in local)
    where = {i: "stage " + ", ".join(f"s{s}" for s in indices)
             for i, indices in readers.items()}
    for i in trainable:
        where.setdefault(i, "read by no pipeline stage")
    check_covered(expected, produced, trainable, where)
    return frozenset(i for i, made in produced.items() if made is False)
