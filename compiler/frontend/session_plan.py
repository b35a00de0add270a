"""The Plan of what one compile session holds: its graphs, kernels, collectives, passes,
parameters and memory (``build_plan``), for ``zeroc.explain`` and for each planned position."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

import torch
import torch.distributed as dist

from zeroc.frontend.session import SESSION_ATTR, CompileSession, compiled_regions
from zeroc.runtime.cost.cost import ADAM_STATES
from zeroc.runtime.layout import ZeroLayout
from zeroc.runtime.mesh import resolve_group
from zeroc.runtime.plan.plan import PLAN_FORMAT, Plan, PlanMeta, launched
from zeroc.runtime.plan.records import (
    CollectiveInfo,
    GraphInfo,
    KernelInfo,
    MemoryEstimate,
    ParamInfo,
    StageInfo,
)
from zeroc.runtime.program import ProgramRecord, frozen_mapping
from zeroc.runtime.secondary_shard import secondary_groups
from zeroc.sharding.tune_cache import layout_match

# Adam keeps two fp32 moments per parameter element.


def _versions() -> tuple[str, str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        zeroc_version = version("zeroc")
    except PackageNotFoundError:
        zeroc_version = "unknown"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return zeroc_version, torch.__version__, triton_version


def session_of(compiled: Any) -> CompileSession:
    """The one session of ``compiled``, or its compiled regions' sessions gathered in one.

    A region is ``compiled`` itself (``torch.compile(model)``, ``torch.compile(fn)``,
    ``model.compile()``) or a submodule compiled on its own (per-block compile); each region's
    graphs, kernels, collectives, passes and parameters are named under its module path
    (``layers.0.g0.forward``, ``layers.0.fc.weight``), the root's unchanged.
    """
    regions = compiled_regions(compiled)
    if not regions:
        raise ValueError(
            f"zeroc.explain: {type(compiled).__name__} was not compiled by zeroc; pass what "
            "torch.compile(model, backend=\"zeroc\") returned, or a module that itself or "
            "whose blocks were compiled with .compile(backend=\"zeroc\")"
        )
    names = {str(getattr(w, "compiler_name", "?")) for _, w in regions
             if getattr(w, SESSION_ATTR, None) is None}
    sessions = [(path, getattr(w, SESSION_ATTR)) for path, w in regions
                if getattr(w, SESSION_ATTR, None) is not None]
    sessions = [(path, s) for path, s in sessions if s.programs]
    if not sessions:
        other = sorted(n for n in names if not n.startswith("zeroc"))
        if other:
            raise ValueError(f"zeroc.explain: this object was compiled with backend="
                             f"{other[0]!r}, not zeroc")
        raise ValueError(
            "zeroc.explain: nothing has been compiled yet; torch.compile compiles on the "
            "first call, so call the compiled model once before explaining it (module.compile() "
            "of a module whose forward is torch.nn's own, e.g. a plain nn.Sequential, compiles "
            "nothing: Dynamo skips torch.nn's code there; use torch.compile(module))"
        )
    path, session = sessions[0]
    if len(sessions) == 1 and (not path or session.pipelined() is not None):
        return session  # a pipeline's records keep their names: its schedule refers to them
    if len(sessions) > 1 and any(s.pipelined() is not None for _, s in sessions):
        raise ValueError(
            f"zeroc.explain: a pipeline (pp > 1) is compiled as one region, but "
            f"{[p or '<root>' for p, _ in sessions]} were compiled separately; compile the "
            "whole model with torch.compile(model, backend=\"zeroc\")")
    config = sessions[0][1].config
    for path, session in sessions[1:]:
        if session.config != config:
            differ = sorted(k for k, v in session.config.to_dict().items()
                            if config.to_dict()[k] != v)
            raise ValueError(
                f"zeroc.explain: the compiled regions {sessions[0][0] or '<root>'!r} and "
                f"{path!r} use different options ({', '.join(differ)}); explain each region "
                f"on its own, e.g. zeroc.explain(model.get_submodule({path!r}))")
    merged = CompileSession(config)
    for path, session in sessions:
        for name, program in session.programs.items():
            merged.programs[f"{path}.{name}" if path else name] = dataclasses.replace(
                program, record=_in_region(program.record, name, path))
    return merged


def _in_region(record: ProgramRecord, prefix: str, region: str) -> ProgramRecord:
    """``record`` (of the Program ``prefix``) with every name it gives under the module path
    ``region``."""
    if not region:
        return record

    def name(text: str) -> str:
        return f"{region}.{text}" if text == prefix or text.startswith(f"{prefix}.") else text

    def graph(info: GraphInfo) -> GraphInfo:
        return dataclasses.replace(info, name=name(info.name))

    return dataclasses.replace(
        record,
        params=tuple(dataclasses.replace(p, name=f"{region}.{p.name}") for p in record.params),
        joint=None if record.joint is None else graph(record.joint),
        graphs=tuple(graph(g) for g in record.graphs),
        kernels=tuple(dataclasses.replace(launched(k), name=name(k.name), graph=name(k.graph))
                      for k in record.kernels),
        collectives=tuple(dataclasses.replace(c, name=name(c.name), graph=name(c.graph))
                          for c in record.collectives),
        passes=tuple(dataclasses.replace(p, graph=name(p.graph)) for p in record.passes),
        output_code=frozen_mapping({name(k): v for k, v in record.output_code.items()}),
        collectives_moved=tuple(name(g) for g in record.collectives_moved),
    )


def _unique_params(session: CompileSession) -> tuple[ParamInfo, ...]:
    seen: dict[str, ParamInfo] = {}
    for record in session.records():
        for param in record.params:
            seen.setdefault(param.name, param)
    return tuple(seen.values())


def _with_full_shapes(params: tuple[ParamInfo, ...],
                      layout: ZeroLayout | None) -> tuple[ParamInfo, ...]:
    """``params`` with the shape each has in the model where the graphs read it flattened or
    sharded (``ParamInfo.full_shape``)."""
    if layout is None:
        return params
    shards = layout.by_name()
    return tuple(
        dataclasses.replace(p, full_shape=tuple(shards[p.name].shape))
        if p.name in shards and tuple(shards[p.name].shape) != p.shape else p
        for p in params)


def _full_size(params: tuple[ParamInfo, ...]) -> tuple[int, int]:
    """Elements and bytes of the whole parameters (not their shards)."""
    numel = nbytes = 0
    for p in params:
        whole = math.prod(p.full_shape) if p.full_shape else p.numel
        numel += whole
        nbytes += whole * (p.bytes // p.numel if p.numel else 0)
    return numel, nbytes


def _unique_kernels(kernels: list[KernelInfo]) -> tuple[KernelInfo, ...]:
    """The kernels named ``<graph>.<name>`` (``g0.backward.zeroc_red_2``), unique in the plan
    (a repeat gets ``#2``, ...), each with the configuration it launched with."""
    seen: dict[str, int] = {}
    out = []
    for kernel in kernels:
        kernel = launched(kernel)  # by the compile record's identity, before it is copied
        name = kernel.name if kernel.name.startswith(f"{kernel.graph}.") else (
            f"{kernel.graph}.{kernel.name}")
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name = f"{name}#{seen[name]}"
        out.append(kernel if name == kernel.name else dataclasses.replace(kernel, name=name))
    return tuple(out)


def _with_mesh_dims(collectives: tuple[CollectiveInfo, ...],
                    layout: ZeroLayout | None) -> tuple[CollectiveInfo, ...]:
    """``collectives`` with the mesh dimension ("dp", "pp") whose group runs each; hpZ's
    groups of ``secondary_shard`` data-parallel ranks are "node"."""
    if layout is None:
        return collectives
    names = {layout.mesh.dp_group_name: "dp", layout.mesh.pp_group_name: "pp",
             **dict.fromkeys(secondary_groups(), "node")}
    names.pop("", None)
    return tuple(dataclasses.replace(c, mesh_dim=names[c.group])
                 if c.group in names and not c.mesh_dim else c for c in collectives)


def _memory_rows(layout: ZeroLayout | None, param_bytes: int, activations: int,
                 moved: int) -> tuple[MemoryEstimate, ...]:
    """One estimate per rank of this rank's data-parallel group (every rank of it runs the
    same graphs; the ZeRO layout gives each its own rows), in rank order."""
    if layout is None:
        held = (param_bytes, param_bytes, ADAM_STATES * param_bytes)
        return (MemoryEstimate(rank=0, params=held[0], grads=held[1], optimizer=held[2],
                               activations=activations, peak=sum(held) + activations,
                               moved=moved),)
    mesh = layout.mesh
    ranks = mesh.dp_group_ranks if len(mesh.dp_group_ranks) == layout.dp else (mesh.rank,)
    rows = []
    for dp_index, rank in enumerate(ranks):
        index = dp_index if len(ranks) > 1 else None
        held = layout.held_bytes(ADAM_STATES, dp_index=index)
        rows.append(MemoryEstimate(rank=rank, params=held[0], grads=held[1], optimizer=held[2],
                                   activations=activations, peak=sum(held) + activations,
                                   moved=moved, host=layout.host_bytes(ADAM_STATES, index)))
    return tuple(sorted(rows, key=lambda m: m.rank))


def _world_mesh_zero(session: CompileSession, layout: ZeroLayout | None = None,
                     ) -> tuple[int, tuple[tuple[str, int], ...], int]:
    """World size, (pp, dp) mesh and ZeRO stage: from the model's ``layout`` when it was
    parallelized (a single rank has no mesh), else read from the compiled graphs' markers.

    ZeRO stage -1 means the model was not parallelized (no ``zeroc.unshard`` markers).
    """
    if layout is not None:
        mesh = (("pp", layout.pp), ("dp", layout.dp)) if layout.world > 1 else ()
        return layout.world, mesh, layout.zero
    records = session.records()
    zero = max((r.zero for r in records), default=-1)
    if zero < 0 or not dist.is_initialized():
        return 1, (), zero
    world = dist.get_world_size()
    group = resolve_group(records[0].zero_group)
    dp = 1 if group is None else dist.get_world_size(group)
    return world, (("pp", world // dp), ("dp", dp)), zero


def _step_collectives(layout: ZeroLayout) -> tuple[CollectiveInfo, ...]:
    """Collectives outside the compiled graphs: ZeRO-1's all-gather after the optimizer step."""
    nbytes = layout.step_gather_bytes()
    if not nbytes:
        return ()
    params = tuple(r.name for r in layout.params if r.sharded and r.requires_grad)
    dtypes = sorted({r.dtype for r in layout.params if r.sharded and r.requires_grad})
    return (CollectiveInfo(
        name="step.gather0", graph="optimizer.step", op="all_gather",
        group=layout.dp_group_name, params=params, bytes=nbytes,
        issued_at="after optimizer.step()", waited_at="after optimizer.step()",
        dtype=",".join(dtypes)),)


def build_plan(session: CompileSession) -> Plan:
    """The Plan of the Programs a session runs (their records: graphs, kernels, collectives,
    passes) and what was measured (kernel launches; one stage; a memory row per data-parallel
    rank); a pipelined session's stages, schedule and memory come from its pipelined Program
    and what its executor measured (``zeroc.pipeline.pipeline_plan``).

    Kernels are renamed ``<graph>.<name>`` so every name is unique in the plan; collectives
    get the mesh dimension their group belongs to; parameters their shape in the model.
    """
    zeroc_version, torch_version, triton_version = _versions()
    records = session.records()
    graphs = tuple(g for r in records for g in ((r.joint,) if r.joint else ()) + r.graphs)
    # The model's ZeRO layout as a pp = 1 Program holds it (a pipeline's is its own).
    layout = next((p.zero for p in session.programs.values()
                   if p.schedule is None and p.zero is not None), None)
    pipeline = session.pipelined()  # the Program that runs (pp > 1), if any
    mesh_layout = layout if layout is not None else getattr(pipeline, "zero", None)
    params = _with_full_shapes(_unique_params(session), mesh_layout)
    param_bytes = sum(p.bytes for p in params)
    forward_flops = sum(g.flops for g in graphs if g.kind in ("forward", "inference"))
    saved = sum(r.saved_bytes for r in records)
    activations = saved + max((r.transient_bytes for r in records), default=0)
    modules = tuple(dict.fromkeys(p.name.split(".")[0] for p in params))
    full_numel, full_bytes = _full_size(params)
    stage = StageInfo(index=0, modules=modules, params=full_numel, param_bytes=full_bytes,
                      flops=forward_flops, activation_bytes=saved)
    collectives = tuple(c for r in records for c in r.collectives)
    if layout is not None:
        collectives += _step_collectives(layout)
    collectives = _with_mesh_dims(collectives, mesh_layout)
    moved = sum(c.bytes for c in collectives if c.graph.endswith((".forward", ".backward"))
                or c.graph == "optimizer.step")
    graph_hash = hashlib.sha256(
        "\n".join(g.code for g in graphs if g.kind != "joint").encode()).hexdigest()[:16]
    config = session.config
    devices = {str(r.device) for r in records}
    world, mesh, zero = _world_mesh_zero(session, mesh_layout)
    meta = PlanMeta(
        format=PLAN_FORMAT,
        zeroc_version=zeroc_version,
        torch_version=torch_version,
        triton_version=triton_version,
        device=",".join(sorted(devices)) or "cpu",
        world_size=world,
        mesh=mesh,
        zero=zero,
        schedule="none",
        options=tuple((k, str(v)) for k, v in config.to_dict().items()),
        graph_hash=graph_hash,
        option_defaults=tuple((k, str(v)) for k, v in type(config)().to_dict().items()),
        layout_from=getattr(mesh_layout, "tuned_from", ""),
        layout_match=layout_match(mesh_layout),
    )
    plan = Plan(
        meta=meta,
        graphs=graphs,
        stages=(stage,),
        params=params,
        kernels=_unique_kernels([k for r in records for k in r.kernels]),
        collectives=collectives,
        memory=_memory_rows(layout, param_bytes, activations, moved),
        passes=tuple(p for r in records for p in r.passes),
    )
    if pipeline is not None:  # pp > 1: stages, schedule grid and measured step
        from zeroc.pipeline.pipeline_plan import pipeline_plan

        plan = pipeline_plan(plan, pipeline, session.executors.get(pipeline.name))
    return plan
