"""``str(plan)``: the plan as tables a person can read (tabulate).

Per-rank tables (estimated memory, the pipeline's ranks) show consecutive rows whose figures
are all the same as one row, labelled with its ranks in compact form (``0-7``, ``0,2``,
``0-3,8-11``), so a plan for hundreds of ranks stays a few rows long; a line under such a
table says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

from tabulate import tabulate

if TYPE_CHECKING:
    from zeroc.runtime.plan import Plan
    from zeroc.runtime.records import MemoryEstimate, PipelineInfo

MAX_ROWS = 16
GROUPED_NOTE = ("  rows are grouped when identical: consecutive ranks with the same figures share "
                "one row\n  (0-7: ranks 0 to 7; 0,2: ranks 0 and 2)")

Row = TypeVar("Row")


def format_ranks(ranks: Iterable[int]) -> str:
    """A set of ranks in compact form: runs as ``a-b``, joined by ``,`` (``0-3,8,10-11``)."""
    ordered = sorted(set(ranks))
    runs: list[list[int]] = []
    for rank in ordered:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def group_identical(rows: Iterable[tuple[int, Row]]) -> list[tuple[tuple[int, ...], Row]]:
    """``(rank, row)`` pairs with consecutive equal rows merged into ``(ranks, row)``."""
    groups: list[tuple[list[int], Row]] = []
    for rank, row in rows:
        if groups and groups[-1][1] == row:
            groups[-1][0].append(rank)
        else:
            groups.append(([rank], row))
    return [(tuple(ranks), row) for ranks, row in groups]


def memory_groups(
    memory: Sequence[MemoryEstimate],
) -> list[tuple[tuple[int, ...], MemoryEstimate]]:
    """Consecutive estimates equal in every field but ``rank``, as (ranks, first estimate)."""
    def figures(m: MemoryEstimate) -> tuple[object, ...]:
        return tuple(getattr(m, f.name) for f in dataclasses.fields(m) if f.name != "rank")

    groups = group_identical((i, figures(m)) for i, m in enumerate(memory))
    return [(tuple(memory[i].rank for i in rows), memory[rows[0]]) for rows, _ in groups]


def rank_label(ranks: Sequence[int]) -> int | str:
    """A table's rank cell: the rank itself, or the group in compact form."""
    return ranks[0] if len(ranks) == 1 else format_ranks(ranks)


def human_bytes(n: int) -> str:
    """Bytes as B/KiB/MiB/GiB with one decimal."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_count(n: int) -> str:
    """A count with a k/M/G suffix."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _section(title: str, rows: list[list[object]], headers: list[str], empty: str) -> str:
    if not rows:
        return f"{title}: {empty}"
    shown = rows[:MAX_ROWS]
    text = tabulate(shown, headers=headers, tablefmt="simple")
    if len(rows) > MAX_ROWS:
        text += f"\n... {len(rows) - MAX_ROWS} more"
    return f"{title}:\n{text}"


def render_plan(plan: Plan) -> str:
    """Render every section of ``plan``."""
    meta = plan.meta
    options = ", ".join(f"{k}={v}" for k, v in meta.options)
    mesh = " x ".join(f"{k}={v}" for k, v in meta.mesh) or "single device"
    out = [
        f"zeroc plan {meta.graph_hash}  (zeroc {meta.zeroc_version}, torch "
        f"{meta.torch_version}, triton {meta.triton_version})",
        f"device {meta.device}, world {meta.world_size}, mesh {mesh}, "
        f"zero {meta.zero if meta.zero >= 0 else 'off'}, "
        f"schedule {meta.schedule}",
        f"options: {options}",
    ]
    if plan.estimate is not None:
        e = plan.estimate
        out.append(
            f"estimated step on {e.hardware} ({e.dtype}): {1000 * e.step_s:.1f} ms = compute "
            f"{1000 * e.compute_s:.1f} ms (bubble {100 * e.bubble:.1f}%) + exposed "
            f"communication {1000 * e.exposed_communication_s:.1f} ms + optimizer "
            f"{1000 * e.optimizer_s:.1f} ms (roofline and ring model: zeroc.step_estimate)")
    out.append("")
    out.append(_section(
        "graphs",
        [[g.name, g.kind, g.nodes, g.inputs, g.outputs, human_count(g.flops),
          human_bytes(g.bytes), human_bytes(g.peak_bytes)] for g in plan.graphs],
        ["graph", "kind", "nodes", "inputs", "outputs", "FLOPs", "bytes moved", "peak mem"],
        "none",
    ))
    out.append("")
    out.append(_section(
        "stages",
        [[s.index, ", ".join(s.modules) or "-", human_count(s.params), human_bytes(s.param_bytes),
          human_count(s.flops), human_bytes(s.activation_bytes)] for s in plan.stages],
        ["stage", "modules", "params", "param bytes", "FLOPs", "activations/mb"],
        "none",
    ))
    out.append("")
    total_numel = sum(p.numel for p in plan.params)
    total_bytes = sum(p.bytes for p in plan.params)
    out.append(_section(
        f"parameters ({len(plan.params)} tensors, {human_count(total_numel)} elements, "
        f"{human_bytes(total_bytes)})",
        [[p.name, "x".join(map(str, p.shape)) or "scalar", p.dtype, human_count(p.numel),
          human_bytes(p.bytes)] for p in plan.params],
        ["parameter", "shape", "dtype", "numel", "bytes"],
        "none",
    ))
    out.append("")
    counts = {b: sum(1 for k in plan.kernels if k.backend == b)
              for b in ("triton", "aten", "inductor")}
    shown = ", ".join(f"{n} {b}" for b, n in counts.items() if n or b != "inductor")
    out.append(_section(
        f"kernels ({len(plan.kernels)}: {shown})",
        [[k.name, k.graph, k.backend, k.kind, _ops(k.ops), human_count(k.numel),
          _launch(k.block)] for k in plan.kernels],
        ["kernel", "graph", "runs as", "kind", "ops", "numel", "launch"],
        "none",
    ))
    out.append("")
    out.append(_section(
        "collectives",
        [[c.name, c.graph, c.op, c.dtype, c.group, len(c.params), human_bytes(c.bytes),
          c.issued_at, c.waited_at] for c in plan.collectives],
        ["collective", "graph", "op", "dtype", "group", "params", "bytes", "issued at",
         "waited at"],
        "none (single device)",
    ))
    out.append("")
    if plan.pipeline is not None:
        out.append(render_pipeline(plan.pipeline))
        out.append("")
    memory = memory_groups(plan.memory)
    out.append(_section(
        "estimated memory per rank",
        [[rank_label(ranks), human_bytes(m.params), human_bytes(m.grads),
          human_bytes(m.optimizer), human_bytes(m.params + m.grads + m.optimizer),
          human_bytes(m.activations), human_bytes(m.peak), human_bytes(m.moved)]
         for ranks, m in memory],
        ["rank", "params", "grads", "optimizer (Adam)", "at rest", "activations", "peak",
         "moved per step"],
        "none",
    ))
    out.append("  at rest = params + grads + optimizer state held between steps; peak = at rest +"
               " activations (estimated);\n  moved per step = collective bytes per training step"
               " (all-gather / reduce-scatter of X bytes: X, all-reduce: 2X)")
    if len(memory) < len(plan.memory):
        out.append(GROUPED_NOTE)
    out.append("")
    out.append(_section(
        "passes",
        [[p.graph, p.pass_name, f"{p.nodes_before} -> {p.nodes_after}",
          ", ".join(f"{k}={v}" for k, v in p.stats)] for p in plan.passes],
        ["graph", "pass", "nodes", "stats"],
        "none",
    ))
    return "\n".join(out)


def _launch(block: tuple[tuple[str, int], ...]) -> str:
    """A kernel's launch configuration, e.g. ``BLOCK_R=8 BLOCK_C=64 warps=4`` (``-``: none)."""
    if not block:
        return "-"
    return " ".join(f"{'warps' if name == 'num_warps' else name}={value}"
                    for name, value in block)


def _ops(ops: tuple[str, ...]) -> str:
    # "aten.add.Tensor" (zeroc's kernels) and "aten.add" (Inductor's) both read "add".
    text = " ".join((op.rsplit(".", 1)[0] if op.count(".") >= 2 else op).replace("aten.", "")
                    for op in ops)
    return text if len(text) <= 48 else text[:45] + "..."


def render_pipeline(info: PipelineInfo) -> str:
    """The schedule grid (ranks by time) and, per rank, bubble ratio and peak activations."""
    rows = []
    for rank in range(info.num_ranks):
        stages = ",".join(str(s) for s, ranks in enumerate(info.placement) if rank in ranks)
        measured = (f"{100 * info.measured_bubble_ratios[rank]:.1f}%"
                    if info.measured_bubble_ratios else "-")
        wait = (f"{info.measured_p2p_wait_ms[rank]:.1f}" if info.measured_p2p_wait_ms
                else "-")
        rows.append((rank, (stages, f"{100 * info.bubble_ratios[rank]:.1f}%", measured, wait,
                            info.peak_activations[rank],
                            human_bytes(info.peak_activation_bytes[rank]))))
    groups = group_identical(rows)
    table = tabulate([[rank_label(ranks), *row] for ranks, row in groups],
                     headers=["rank", "stages", "bubble (model)", "bubble (measured)",
                              "p2p wait (ms, measured)", "peak activations (micro-batches)",
                              "peak activation memory"])
    if len(groups) < len(rows):
        table += "\n" + GROUPED_NOTE
    return (f"pipeline: schedule {info.schedule}, {info.num_ranks} ranks, {info.num_stages} "
            f"stages, {info.num_microbatches} micro-batches\n{info.grid}\n\n{table}")
