"""Pipeline stage graphs compiled by Inductor (``kernels="inductor"``, or ``"auto"`` on CUDA).

A stage has up to six graphs (forward, full backward, its input-gradient and weight-gradient
halves, the F&B graphs of DualPipe's overlapped actions, the ``no_grad`` forward), and a
schedule runs only some of them: 1F1B never runs the I/W halves, ZB1P never runs the full
backward. Each graph is therefore compiled on its first call, from the example values its
placeholders carry (never from the call's tensors, so compiling does not depend on which
micro-batch comes first); the plan's kernels table and ``output_code`` gain its kernels then.
Everything the training step runs has been compiled by the end of the first step.

The F&B graphs are built from the stages' FX graphs (``passes/overlap_fb.py``), so they are
made before anything here replaces those graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch.fx

from zeroc.codegen.inductor_graphs import InductorGraph
from zeroc.frontend.session import CompiledGraph
from zeroc.passes.overlap_fb import OverlappedGraph
from zeroc.runtime.pipeline_program import StageProgram

__all__ = ["LazyInductorGraph", "compile_stages_with_inductor"]

logger = logging.getLogger(__name__)

STAGE_GRAPHS = ("forward", "backward", "input_grad", "weight_grad")


class LazyInductorGraph:
    """``gm`` compiled by Inductor on its first call; called like ``gm``."""

    def __init__(self, gm: torch.fx.GraphModule, name: str, record: CompiledGraph,
                 autotune: bool = False) -> None:
        self.gm: torch.fx.GraphModule | None = gm
        self.autotune = autotune
        self.name = name
        self.record = record
        self.compiled: InductorGraph | None = None

    def _compile(self) -> InductorGraph:
        assert self.gm is not None
        logger.info("zeroc: compiling %s with Inductor", self.name)
        compiled = InductorGraph(self.gm, self.name, autotune=self.autotune)
        self.record.kernels.extend(compiled.kernels)
        self.record.output_code[self.name] = compiled.source_code
        if not compiled.collectives_kept:
            self.record.collectives_moved.append(self.name)
        self.gm = None  # the compiled code is all that runs from now on
        return compiled

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            self.compiled = self._compile()
        return self.compiled.run_boxed(list(args))


def inductor_after(compile_graph: Callable[[torch.fx.GraphModule], torch.fx.GraphModule],
                   name: str, record: CompiledGraph, autotune: bool = False
                   ) -> Callable[[torch.fx.GraphModule], Any]:
    """``compile_graph`` (zeroc's passes) followed by Inductor: for the lazy inference graph."""
    def compile_both(gm: torch.fx.GraphModule) -> Any:
        compiled = InductorGraph(compile_graph(gm), name, autotune=autotune)
        record.kernels.extend(compiled.kernels)
        record.output_code[name] = compiled.source_code
        if not compiled.collectives_kept:
            record.collectives_moved.append(name)
        return compiled

    return compile_both


def compile_stages_with_inductor(programs: dict[int, StageProgram], record: CompiledGraph,
                                 autotune: bool = False) -> None:
    """Make every graph of ``programs`` run through Inductor (compiled on first call;
    ``autotune``: Inductor's ``max_autotune``)."""
    for index, program in programs.items():
        stage_name = f"{record.prefix}.s{index}"
        for kind in STAGE_GRAPHS:
            gm = getattr(program, kind)
            setattr(program, kind,
                    LazyInductorGraph(gm, f"{stage_name}.{kind}", record, autotune))
        for b_stage, overlapped in list(program.overlapped.items()):
            assert isinstance(overlapped, OverlappedGraph)
            program.overlapped[b_stage] = OverlappedGraph(
                LazyInductorGraph(overlapped.gm, f"{stage_name}.fb{b_stage}", record, autotune),
                overlapped.num_forward_outputs)
