"""Inductor for zeroc's functional graphs: ``options={"kernels": "inductor"}``.

zeroc's passes produce plain functional aten graphs (the ZeRO gathers and gradient reductions
are ``_c10d_functional`` issue/wait pairs inside them). Inductor compiles such a graph as it
compiles its own: ``compile_fx_inner`` lowers it, fuses pointwise and reduction chains into
generated kernels (C++/OpenMP on CPU, Triton on CUDA), leaves matmuls to the vendor library,
and keeps each collective as an extern call with its wait. Its reordering of collectives for
overlap (``reorder_for_compute_comm_overlap``) is off by default; its reorderings for locality
and peak memory are turned off for graphs with collectives (they moved ZeRO-3's prefetched
gathers next to their waits), so the gathers are issued and waited in the graph's order, where
zeroc's passes put them. ``code_collective_order``
reads that order (with the matmuls between) back from the output code and
``graph_collective_order`` from zeroc's graph; ``InductorGraph.collectives_kept`` says whether
they agree, and a warning names any graph where Inductor moved them.

``inductor_kernels`` lists the kernels from Inductor's output code (their name, kind and the
aten ops that Inductor says each one covers), for the plan's kernels table.

Which path a graph takes (``kernel_path``): ``"inductor"`` when asked for, and by default on
CUDA (zeroc's own Triton is chosen over it only once a GPU benchmark shows it faster);
otherwise what ``choose_backend`` says for zeroc's own kernels (``"triton"`` or ``"aten"``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from zeroc.codegen.fused_kernel import choose_backend
from zeroc.runtime.collectives import ISSUE_OPS, WAIT_OP
from zeroc.runtime.plan.records import KernelInfo

__all__ = ["InductorGraph", "code_collective_order", "compile_graph", "graph_collective_order",
           "inductor_kernels", "inductor_decompositions", "kernel_path"]

logger = logging.getLogger(__name__)

# A kernel Inductor generated: ``name = async_compile.cpp_pybinding(...)`` / ``.triton(...)``.
_KERNEL_DEFINITION = re.compile(r"^(\w+) = async_compile\.(\w+)\(", re.MULTILINE)
_ORIGINAL_ATEN = re.compile(r"Original ATen: \[([^\]]*)\]")
_XNUMEL = re.compile(r"^\s*xnumel = (\d+)", re.MULTILINE)
_COLLECTIVE_CALL = re.compile(r"torch\.ops\._c10d_functional\.(\w+)\.default\(")
_EXTERN_MATMUL = re.compile(r"extern_kernels\.(?:mm|addmm|bmm|baddbmm)\(")
# Inductor options that reorder a graph's nodes (off by default: reorder_for_compute_comm_overlap).
ORDER_CHANGING_OPTIONS = ("reorder_for_locality", "reorder_for_peak_memory")
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
            torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default}


def kernel_path(kernels: str, device: torch.device) -> str:
    """How a graph of ``device`` is compiled for the ``kernels`` option.

    ``"inductor"``: by Inductor (asked for, or ``"auto"`` on CUDA); otherwise
    ``choose_backend``'s answer for zeroc's own kernels, ``"triton"`` or ``"aten"`` (which
    raises the option's error for a value that is not allowed).
    """
    if kernels == "inductor" or (kernels == "auto" and device.type == "cuda"):
        return "inductor"
    return choose_backend(kernels, device)


def inductor_decompositions() -> dict[Any, Any]:
    """The decompositions Inductor expects its input graphs to be traced with."""
    from zeroc.runtime.torch_compat import select_decomp_table

    return dict(select_decomp_table())


def _kind(name: str, flavour: str) -> str:
    if name.startswith("triton_poi"):
        return "pointwise"
    if name.startswith("triton_per"):
        return "persistent_reduction"
    if name.startswith("triton_red"):
        return "reduction"
    if name.startswith("triton_tem"):
        return "template"
    return "cpp" if flavour.startswith("cpp") else flavour


def _name_ops(name: str) -> tuple[str, ...]:
    """What a kernel's name says it covers: ``cpp_fused_add_gelu_3`` -> ``("add_gelu",)``."""
    body = re.sub(r"_\d+$", "", name)
    body = body.split("_fused_", 1)[1] if "_fused_" in body else body
    return (body,)


def inductor_kernels(source: str, graph: str) -> tuple[KernelInfo, ...]:
    """The kernels of Inductor's output code ``source`` for the plan, in launch order.

    ``ops``: the aten ops of Inductor's ``Original ATen`` comment above the kernel's definition
    (Triton kernels have one), otherwise the ops its name is made of (C++ kernels).
    ``numel``: a Triton kernel's ``xnumel`` (0 where the code does not state it).
    """
    definitions = list(_KERNEL_DEFINITION.finditer(source))
    by_name: dict[str, tuple[str, str, tuple[str, ...], int]] = {}
    previous_end = 0
    for index, match in enumerate(definitions):
        name, flavour = match.group(1), match.group(2)
        until = definitions[index + 1].start() if index + 1 < len(definitions) else len(source)
        kernel_source = source[match.start():until]
        comments = _ORIGINAL_ATEN.findall(source[previous_end:match.start()])
        ops = (tuple(op.strip() for op in comments[-1].split(",") if op.strip())
               if comments else _name_ops(name))
        numel = _XNUMEL.search(kernel_source)
        by_name[name] = (flavour, kernel_source, ops, int(numel.group(1)) if numel else 0)
        previous_end = match.end()
    body_start = source.find("def call(")
    launched: list[KernelInfo] = []
    for line in source[max(body_start, 0):].splitlines():
        name = line.strip().split("(", 1)[0].split(".run", 1)[0]
        if name not in by_name or any(k.name == name for k in launched):
            continue
        flavour, kernel_source, ops, numel = by_name[name]
        launched.append(KernelInfo(
            name=name, graph=graph, backend="inductor", kind=_kind(name, flavour), ops=ops,
            numel=numel, source=kernel_source, source_hash="", block=()))
    return tuple(launched)


def _code_event(line: str) -> str | None:
    collective = _COLLECTIVE_CALL.search(line)
    if collective:
        op = collective.group(1).rstrip("_")  # Inductor runs all_reduce in place
        return "wait" if op == "wait_tensor" else f"issue {op}"
    matmul = _EXTERN_MATMUL.search(line)
    return "matmul" if matmul else None


def code_collective_order(source: str) -> tuple[str, ...]:
    """Inductor's output code read as collectives and matmuls in the order they run:
    ``"issue <op>"``, ``"wait"`` and ``"matmul"`` (the compute a prefetch hides behind)."""
    body = source[max(source.find("def call("), 0):]
    events = (_code_event(line) for line in body.splitlines())
    return tuple(e for e in events if e is not None)


def graph_collective_order(gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """The same reading of a functional graph, for comparison with ``code_collective_order``."""
    events = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is WAIT_OP:
            events.append("wait")
        elif node.target in ISSUE_OPS:
            events.append(f"issue {node.target._opname}")
        elif node.target in _MATMULS:
            events.append("matmul")
    return tuple(events)


def _fresh_inputs(gm: torch.fx.GraphModule) -> list[Any]:
    """Example inputs for ``gm`` from its placeholders' ``val`` metadata, in one fake mode.

    The graphs zeroc builds by hand (a stage's I/W split, the F&B graph) copy metadata from
    graphs traced separately, so their fake tensors come from different fake modes; Inductor
    needs one. Static shapes only: every pipeline graph is traced at the micro-batch size.
    """
    from zeroc.runtime.torch_compat import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs: list[Any] = []
    with mode:
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                inputs.append(torch.empty_strided(
                    tuple(int(s) for s in value.shape), tuple(int(s) for s in value.stride()),
                    dtype=value.dtype, device=value.device, requires_grad=False))
            elif value is None:
                raise ValueError(f"zeroc kernels='inductor': input {node.name} of a graph has "
                                 "no example value to compile it with")
            else:
                inputs.append(value)
    return inputs


class InductorGraph:
    """A functional graph compiled by Inductor, called like the ``GraphModule`` it replaces.

    ``source_code`` is Inductor's output code; ``kernels`` its kernels for the plan.
    """

    def __init__(self, gm: torch.fx.GraphModule, name: str,
                 example_inputs: list[Any] | None = None, autotune: bool = False) -> None:
        from zeroc.runtime.torch_compat import compile_fx_inner

        inputs = _fresh_inputs(gm) if example_inputs is None else example_inputs
        self.name = name
        planned = graph_collective_order(gm)
        self.returns_tuple = _returns_sequence(gm)
        if not self.returns_tuple:
            _make_return_tuple(gm)
        from zeroc.runtime.torch_compat import inductor_config

        # A graph with collectives keeps zeroc's node order: Inductor's locality and
        # peak-memory reorderings would otherwise move a prefetched gather next to its wait.
        keep_order = {k: False for k in ORDER_CHANGING_OPTIONS if hasattr(inductor_config, k)
                      } if any(e.startswith("issue") for e in planned) else {}
        # kernel_autotune (or mode="max-autotune") is Inductor's max_autotune on this path.
        tuning = {"max_autotune": True} if autotune else {}
        with inductor_config.patch({**keep_order, **tuning}):
            self.compiled: Callable[[list[Any]], Any] = compile_fx_inner(gm, inputs)
        self.source_code: str = getattr(self.compiled, "source_code", "") or ""
        self.kernels = inductor_kernels(self.source_code, name)
        # Whether Inductor kept zeroc's order of collectives and the matmuls between them
        # (where a prefetched gather hides); where it did not, say so.
        ran = code_collective_order(self.source_code)
        self.collectives_kept = ran == planned
        if not self.collectives_kept:
            pairs = zip(planned, ran, strict=False)
            at = next((i for i, (a, b) in enumerate(pairs) if a != b),
                      min(len(planned), len(ran)))
            logger.warning(
                "zeroc: Inductor ran the collectives of %s in another order than zeroc's "
                "graph: at event %d the graph has %s and the code %s (%d and %d events)",
                name, at, planned[at:at + 3], ran[at:at + 3], len(planned), len(ran))
        logger.debug("zeroc: Inductor compiled %s into %d kernels", name, len(self.kernels))

    def run_boxed(self, args: list[Any]) -> Any:
        """Run with the boxed convention: ``args`` is consumed."""
        out = self.compiled(args)
        return out if self.returns_tuple else out[0]

    def __call__(self, *args: Any) -> Any:
        return self.run_boxed(list(args))


def _returns_sequence(gm: torch.fx.GraphModule) -> bool:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return isinstance(output.args[0], (tuple, list))


def _make_return_tuple(gm: torch.fx.GraphModule) -> None:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    output.args = ((output.args[0],),)
    gm.recompile()


def compile_graph(gm: torch.fx.GraphModule, name: str,
                  example_inputs: list[Any] | None = None, autotune: bool = False
                  ) -> InductorGraph:
    """``gm`` compiled by Inductor (``example_inputs``: fake inputs; None: from metadata;
    ``autotune``: Inductor's ``max_autotune``)."""
    return InductorGraph(gm, name, example_inputs, autotune)
