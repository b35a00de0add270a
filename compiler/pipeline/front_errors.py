"""The errors of a pipeline front that name the user's code: where the graph broke, and
which inputs were cut into micro-batches when the model fails at the micro-batch size.

A pipeline needs the model's whole forward as one Dynamo graph (``check_one_graph`` names
the line Dynamo broke at and why); the front then runs it on micro-batches, and a model
that fails there is told which of its inputs were cut (``cut_failed``).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
import torch.fx

import zeroc.codegen as zeroc_codegen
import zeroc.passes as zeroc_passes
import zeroc.runtime as zeroc_runtime
from zeroc.frontend.capture import source_name
from zeroc.runtime.layout import ZeroLayout
from zeroc.runtime.torch_compat import graph_break_reasons

__all__ = ["check_one_graph", "cut_failed"]


def cut_failed(error: Exception, gm: torch.fx.GraphModule, batch_inputs: set[int],
                batch: int, microbatch: int) -> ValueError:
    """The error for a graph that fails at the micro-batch size: name what was cut."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    cut = sorted(source_name(placeholders[i]) for i in batch_inputs)
    return ValueError(
        f"zeroc pipeline: the model fails on micro-batches of {microbatch} of its batch of "
        f"{batch} ({type(error).__name__}: {str(error).strip().splitlines()[0]}). Every "
        f"tensor input whose dimension 0 is the batch is cut into micro-batches: {cut}. If "
        "one of them is not batch-shaped (a weight or a table that happens to have "
        f"{batch} rows), pass it whole with options={{'unsplit_inputs': ['name']}}")


# Frames of these files are zeroc's or torch's own, not the user's (a stack trace's outer
# frames are the model's, its inner ones the library code the model called).
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                      for m in (torch, zeroc_passes, zeroc_codegen, zeroc_runtime)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)  # compiler/


def _user_frame(frames: list[tuple[str, int, str]]) -> str | None:
    """``file, line N: code`` of the innermost frame outside zeroc and torch."""
    for filename, line, code in reversed(frames):
        if not os.path.abspath(filename).startswith(_LIBRARY_DIRS):
            return f"{filename}, line {line}: {code}" if code else f"{filename}, line {line}"
    return None


def _where(node: torch.fx.Node | None) -> str | None:
    """``file, line N: code`` of the user's source line that traced ``node``."""
    trace = (node.meta.get("stack_trace") or "") if node is not None else ""
    lines = [line.strip() for line in trace.strip().splitlines()]
    frames = []
    for i, line in enumerate(lines):
        match = re.match(r'File "([^"]+)", line (\d+)', line)
        if match:
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith(
                "File ") else ""
            frames.append((match.group(1), int(match.group(2)), code))
    return _user_frame(frames)


def _break_reason(gm: torch.fx.GraphModule) -> str:
    """Why Dynamo ended the graph, and the user's line it broke at. Dynamo leaves a
    ``compile_subgraph_reason`` (reason text, user stack) on each graph it hands a backend;
    when this graph ended without a break (Dynamo gave up on an outer frame and compiled an
    inner one, such as an embedding's forward, on its own), the latest break it recorded."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        recorded = graph_break_reasons() or [None]
        reason = recorded[-1]
    if reason is None:
        return ""
    stack = [(f.filename, f.lineno, (f.line or "").strip())
             for f in getattr(reason, "user_stack", None) or ()]
    where = _user_frame(stack)
    first = str(getattr(reason, "reason", "")).strip().splitlines()
    what = first[0] if first else "a graph break"
    return f" Dynamo broke the graph at {where or 'an unknown line'}: {what}."


def check_one_graph(gm: torch.fx.GraphModule, layout: ZeroLayout, params: set[int],
                     traced: torch.fx.GraphModule, inputs: list[Any]) -> None:
    """A pipeline needs the whole forward as one graph; ``traced``: the graph as Dynamo handed
    it over (it carries the break's reason)."""
    if len(params) >= len(layout.params):
        return
    ops = [n for n in gm.graph.nodes if n.op.startswith("call")]
    lines = [where for n in ops if (where := _where(n)) is not None]
    names = sorted(name for i in params if (name := getattr(
        getattr(inputs[i], "_zeroc_param", None), "param_name", None)))
    reads = f" (it reads {', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
    raise ValueError(
        f"zeroc pipeline: this graph uses {len(params)} of the model's {len(layout.params)} "
        f"parameters{reads if names else ''}; with pp={layout.pp} the whole forward must be "
        f"one graph. Dynamo split it"
        f"{f': this graph runs from {lines[0]} to {lines[-1]}' if lines else ''}."
        f"{_break_reason(traced)} "
        "Remove what breaks the graph there (data-dependent Python control flow, .item(), "
        "print; torch._dynamo.explain(model)(*inputs) names the reason) or the unused "
        "parameters"
    )
