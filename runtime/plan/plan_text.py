"""``str(plan)``: the plan as tables a person can read (tabulate).

A header (hash, versions, device, world, mesh, ZeRO stage, the options that differ from the
defaults), then one table per section, each followed by a short legend of its units and
columns: graphs (empty ones left out, and named), stages, parameters (their shapes as the
model defines them next to the shards the graphs read), kernels (named uniquely:
``<graph>.<function>``), collectives (the mesh dimension each runs over), the pipeline's
schedule, the estimated memory per rank and the passes. Sizes are in B/KiB/MiB/GiB
everywhere, pass statistics that count bytes included.

``render_plan(plan, max_rows=None, all_options=True)`` (``str(plan.full())``) shows every row
and every option; a table cut at ``MAX_ROWS`` says how many rows it left out and how to see
them. The helpers (units, rank sets, grouped rows) are in ``zeroc.runtime.plan.plan_format``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tabulate import tabulate

from zeroc.runtime.plan.plan_format import (
    GROUPED_NOTE,
    MAX_ROWS,
    MORE_HINT,
    format_ranks,
    group_identical,
    human_bytes,
    human_count,
    legend,
    memory_groups,
    rank_label,
    shape_text,
    stat_text,
    table,
    wrap,
)

if TYPE_CHECKING:
    from zeroc.runtime.plan.plan import Plan, PlanMeta
    from zeroc.runtime.plan.records import ParamInfo, PipelineInfo

__all__ = ["GROUPED_NOTE", "MAX_ROWS", "MORE_HINT", "format_ranks", "group_identical",
           "human_bytes", "human_count", "memory_groups", "rank_label", "render_pipeline",
           "render_plan"]

MEMORY_LEGEND = (
    "at rest = params + grads + optimizer state held between steps; peak = at rest + "
    "activations; moved per step = collective bytes a training step sends (ZeRO accounting)")


# What each ZeRO stage holds on a rank and moves per step (the README's stage table).
ZERO_STAGE_TEXT = {
    0: "whole parameters, gradients and optimizer state; gradients all-reduced",
    1: "whole parameters; gradients and optimizer state this rank's rows; gradients "
       "reduce-scattered, parameters all-gathered after optimizer.step()",
    2: "parameters, gradients and optimizer state this rank's rows; parameters gathered once "
       "per forward, gradients reduce-scattered",
    3: "parameters, gradients and optimizer state this rank's rows; parameters gathered where "
       "used (again in the backward), gradients reduce-scattered",
}


def _header(plan: Plan, all_options: bool) -> list[str]:
    meta = plan.meta
    mesh = " x ".join(f"{k}={v}" for k, v in meta.mesh) or "single device"
    place = (f"device {meta.device}, world {meta.world_size}, mesh {mesh}, "
             f"zero {meta.zero if meta.zero >= 0 else 'off'}")
    if meta.schedule != "none":
        place += f", schedule {meta.schedule}"
    first = (f"zeroc plan {meta.graph_hash}  (zeroc {meta.zeroc_version}, torch "
             f"{meta.torch_version}, triton {meta.triton_version})")
    if meta.layout_from:  # where a cached layout came from, on the first line
        first = wrap(f"{first}; layout and options tuned by zeroc.tune "
                     f"(parallelize(layout='auto')), from {meta.layout_from}"
                     + (f": {meta.layout_match}" if meta.layout_match else ""), "  ")
    lines = [first, place]
    if meta.zero in ZERO_STAGE_TEXT and meta.world_size > 1:
        lines.append(wrap(f"zero {meta.zero}: {ZERO_STAGE_TEXT[meta.zero]}", "  "))
    lines.append(wrap(_options_line(meta, all_options), "  "))
    if plan.estimate is not None:
        e = plan.estimate
        lines.append(wrap(
            f"estimated step on {e.hardware} ({e.dtype}): {1000 * e.step_s:.1f} ms = compute "
            f"{1000 * e.compute_s:.1f} ms (bubble {100 * e.bubble:.1f}% of it idle) + exposed "
            f"communication {1000 * e.exposed_communication_s:.1f} ms + optimizer "
            f"{1000 * e.optimizer_s:.1f} ms (roofline and ring model: "
            "zeroc.world.step_estimate)", "  "))
        if e.kinds:
            lines.append(wrap("  by action kind on the slowest rank: " + ", ".join(
                f"{k} {1000 * v:.3g} ms" for k, v in e.kinds) + "; per graph: the graphs "
                "table's 'est. time' column", "  "))
    return lines


def _options_line(meta: PlanMeta, all_options: bool) -> str:
    """Every option (``all_options`` or no defaults known), else those that differ."""
    if all_options or not meta.option_defaults:
        return "options: " + ", ".join(f"{k}={v}" for k, v in meta.options)
    defaults = dict(meta.option_defaults)
    changed = [f"{k}={v}" for k, v in meta.options if defaults.get(k) != v]
    if not changed:
        return "options: all defaults (every option: str(plan.full()))"
    return f"options: {', '.join(changed)} (the rest are defaults; all: str(plan.full()))"


def _graphs(plan: Plan, max_rows: int | None) -> str:
    shown = [g for g in plan.graphs if g.nodes > 0]
    note = ("per call, from the cost model: nodes = ops; bytes moved = tensor bytes read + "
            "written; peak mem = most bytes live at once, inputs included")
    empty = [g.name for g in plan.graphs if g.nodes == 0]
    if empty:
        note += f"; not shown, empty (no ops): {', '.join(empty)}"
    estimated = dict(plan.estimate.graphs) if plan.estimate is not None else {}
    extra = (lambda g: [f"{1000 * estimated[g.name]:.3g} ms" if g.name in estimated else ""]
             ) if estimated else (lambda g: [])
    if estimated:
        note += (f"; est. time = one call on {plan.estimate.hardware} (roofline per op, at "
                 "least the launch floor)")
    return table(
        "graphs",
        [[g.name, g.kind, g.nodes, g.inputs, g.outputs, human_count(g.flops),
          human_bytes(g.bytes), human_bytes(g.peak_bytes), *extra(g)] for g in shown],
        ["graph", "kind", "nodes", "inputs", "outputs", "FLOPs", "bytes moved", "peak mem",
         *(["est. time"] if estimated else [])],
        "none" if not empty else f"none with ops ({', '.join(empty)} are empty)",
        max_rows, note if shown else "")


def _stages(plan: Plan, max_rows: int | None) -> str:
    pipelined = plan.pipeline is not None
    return table(
        "stages",
        [[s.index, ", ".join(s.modules) or "-", human_count(s.params), human_bytes(s.param_bytes),
          human_count(s.flops), human_bytes(s.activation_bytes)] for s in plan.stages],
        ["stage", "modules", "params", "param bytes", "FLOPs", "activations/mb"],
        "none", max_rows,
        "params: elements of the whole parameters it reads (not shards); FLOPs: its forward; "
        "activations/mb: bytes saved for the backward per micro-batch"
        + ("" if pipelined else " (no pipeline: the whole batch)"))


def _full_shape(p: ParamInfo) -> tuple[int, ...]:
    return p.full_shape or p.shape


def _params(plan: Plan, max_rows: int | None) -> str:
    params = plan.params
    full = [math.prod(_full_shape(p)) for p in params]
    sharded = any(p.numel < n for p, n in zip(params, full, strict=True))
    flat = any(p.full_shape for p in params)
    total_bytes = sum(p.bytes for p in params)
    if not sharded:
        title = (f"parameters ({len(params)} tensors, {human_count(sum(full))} elements, "
                 f"{human_bytes(total_bytes)})")
        rows = [[p.name, shape_text(_full_shape(p)), p.dtype, human_count(n),
                 human_bytes(p.bytes)] for p, n in zip(params, full, strict=True)]
        headers = ["parameter", "shape", "dtype", "numel", "bytes"]
        note = ("shape: as the model defines it (the compiled graphs read a flat 1-D buffer "
                "of it)" if flat else "")
        return table(title, rows, headers, "none", max_rows, note)
    dp = dict(plan.meta.mesh).get("dp", 1)
    title = (f"parameters ({len(params)} tensors, {human_count(sum(full))} elements; this "
             f"rank's shards: {human_count(sum(p.numel for p in params))} elements, "
             f"{human_bytes(total_bytes)})")
    rows = [[p.name, shape_text(_full_shape(p)), p.dtype, human_count(n), human_count(p.numel),
             human_bytes(p.bytes)] for p, n in zip(params, full, strict=True)]
    headers = ["parameter", "shape", "dtype", "numel", "shard numel", "shard bytes"]
    note = (f"shape, numel: as the model defines it; shard: the flat 1-D buffer the graphs "
            f"read on each rank: 1/{dp} of dimension 0's rows, rounded up and zero-padded")
    return table(title, rows, headers, "none", max_rows, note)


def _kernels(plan: Plan, max_rows: int | None) -> str:
    counts = {b: sum(1 for k in plan.kernels if k.backend == b)
              for b in ("triton", "aten", "inductor")}
    shown = ", ".join(f"{n} {b}" for b, n in counts.items() if n or b != "inductor")
    return table(
        f"kernels ({len(plan.kernels)}: {shown})",
        [[k.name, k.backend, k.kind, _ops(k.ops), human_count(k.numel), _launch(k.block)]
         for k in plan.kernels],
        ["kernel", "runs as", "kind", "ops", "numel", "launch"],
        "none", max_rows,
        "kernel = <graph>.<function> (source: plan.kernel(name).source); numel = elements it "
        "iterates over; launch = launch parameters (-: none)")


def _collectives(plan: Plan, max_rows: int | None) -> str:
    sizes = dict(plan.meta.mesh)
    secondary = dict(plan.meta.options).get("secondary_shard", "None")
    if secondary != "None":  # hpZ's groups, within a data-parallel group
        sizes["node"] = f"{secondary} (hpZ: consecutive dp ranks)"
    dims = sorted({c.mesh_dim for c in plan.collectives if c.mesh_dim})
    over = ", ".join(f"{d}: {sizes[d]} ranks" if d in sizes else d for d in dims)
    return table(
        "collectives",
        [[c.name, c.graph, c.op, c.dtype, c.mesh_dim or f"group {c.group}", len(c.params),
          human_bytes(c.bytes), c.issued_at, c.waited_at] for c in plan.collectives],
        ["collective", "graph", "op", "dtype", "over", "params", "bytes", "issued at",
         "waited at"],
        "none (single device)", max_rows,
        (f"over = the mesh dimension whose group runs it ({over}); " if over else "")
        + "bytes = sent per rank per call (gather / reduce-scatter of X: X, all-reduce: 2X); "
        "issued / waited at = the node it comes before")


def _memory(plan: Plan, max_rows: int | None) -> str:
    memory = memory_groups(plan.memory)
    text = table(
        "estimated memory per rank",
        [[rank_label(ranks), human_bytes(m.params), human_bytes(m.grads),
          human_bytes(m.optimizer), human_bytes(m.params + m.grads + m.optimizer),
          human_bytes(m.activations), human_bytes(m.peak), human_bytes(m.moved)]
         for ranks, m in memory],
        ["rank", "params", "grads", "optimizer (Adam)", "at rest", "activations", "peak",
         "moved per step"],
        "none", max_rows, MEMORY_LEGEND)
    if len(memory) < len(plan.memory):
        text += "\n" + GROUPED_NOTE
    return text


# Graph-name suffixes a pipeline's pass rows use, explained when the table has them.
_PIPELINE_SUFFIXES = (
    (".front", "the pipeline's graph at the call's sizes"),
    (".microbatch", "the graph at one micro-batch's sizes, cut into stages"),
    (".program", "the pipeline program (its stages and schedule)"),
)


def _passes(plan: Plan, max_rows: int | None) -> str:
    suffixes = "".join(f", {suffix} = {what}" for suffix, what in _PIPELINE_SUFFIXES
                       if any(p.graph.endswith(suffix) for p in plan.passes))
    return table(
        "passes",
        [[p.graph, p.pass_name, f"{p.nodes_before} -> {p.nodes_after}",
          ", ".join(stat_text(k, v) for k, v in p.stats)] for p in plan.passes],
        ["graph", "pass", "nodes", "stats"],
        "none", max_rows,
        "nodes = ops before -> after; .dynamo = the Dynamo graph, .joint = the joint graph "
        f"before the split{suffixes}; final graph texts: plan.graph(name).code; every pass's "
        "graph before and after: options={'record_graphs': True}, then "
        "plan.passes_for(graph)[i].before")


def render_plan(plan: Plan, max_rows: int | None = MAX_ROWS, all_options: bool = False) -> str:
    """Render every section of ``plan``: at most ``max_rows`` rows a table (``None``: all),
    every option with ``all_options`` (else those that differ from the defaults)."""
    out = _header(plan, all_options)
    sections = [_graphs(plan, max_rows), _stages(plan, max_rows), _params(plan, max_rows),
                _kernels(plan, max_rows), _collectives(plan, max_rows)]
    if plan.pipeline is not None:
        sections.append(render_pipeline(plan.pipeline))
    sections += [_memory(plan, max_rows), _passes(plan, max_rows)]
    for section in sections:
        out += ["", section]
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


def _time_unit(info: PipelineInfo) -> str:
    """The grid's time unit, from its legend (``ms``, ``the cheapest stage's forward``)."""
    first = info.grid_legend.split("\n", 1)[0]
    if first.startswith("time unit: "):
        return first.removeprefix("time unit: ").split(";", 1)[0].strip()
    return ""


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
    table_text = tabulate([[rank_label(ranks), *row] for ranks, row in groups],
                          headers=["rank", "stages", "bubble (model)", "bubble (measured)",
                                   "p2p wait (ms, measured)",
                                   "peak activations (micro-batches)", "peak activation memory"])
    table_text += "\n" + legend(
        "rank = position in the pipeline; p2p wait = time the last step spent in sends and "
        "receives; peak activations = micro-batches held at once; -: no step measured yet")
    if len(groups) < len(rows):
        table_text += "\n" + GROUPED_NOTE
    unit = _time_unit(info)
    grid_note = legend(
        f"one column, busy, bubble and makespan are in the time unit{f' ({unit})' if unit else ''}"
        ": busy = computing, bubble = idle, makespan = the step's length")
    return (f"pipeline: schedule {info.schedule}, {info.num_ranks} ranks, {info.num_stages} "
            f"stages, {info.num_microbatches} micro-batches\n{info.grid}\n{grid_note}\n\n"
            f"{table_text}")
