"""``zeroc.explain``: the Plan of everything zeroc compiled for a model or function."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from zeroc.runtime.cost import ADAM_STATES
from zeroc.runtime.mesh import resolve_group
from zeroc.runtime.plan import PLAN_FORMAT, Plan, PlanMeta
from zeroc.runtime.records import CollectiveInfo, MemoryEstimate, ParamInfo, StageInfo
from zeroc.runtime.zero_ops import ZeroLayout
from zeroc.session import SESSION_ATTR, CompileSession, wrapper_of

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


def explain(compiled: Any, example_inputs: Any = None, *, world: int | None = None,
            pp: int = 1, zero: int = 3, device: str = "cuda", hardware: Any = None,
            options: dict | None = None, mixed_precision: Any = None) -> Plan:
    """Return the Plan of what zeroc compiled for ``compiled``.

    ``compiled`` is what ``torch.compile(..., backend="zeroc")`` returned. Compilation is
    lazy: call it once before asking for its plan.

    With ``world=W``, plan a job that is not there instead: ``compiled`` is then the model
    (on the meta device or not; it is not changed) and ``example_inputs`` its inputs (a tuple,
    or a dict of keyword inputs); every pipeline position of a W-rank job with ``pp``
    positions and ZeRO stage ``zero`` runs one fake training step on ``device`` in this
    process (``zeroc.world_plan``). ``hardware``: a profile name or dict
    (``zeroc.runtime.hardware``); ``options``: zeroc's compile options.
    """
    if world is not None:
        from zeroc.world_plan import plan_world

        return plan_world(compiled, example_inputs, world=world, pp=pp, zero=zero,
                          device=device, hardware=hardware, options=options,
                          mixed_precision=mixed_precision)
    wrapper = wrapper_of(compiled)
    if wrapper is None:
        raise ValueError(
            f"zeroc.explain: {type(compiled).__name__} was not compiled by zeroc; pass what "
            "torch.compile(model, backend=\"zeroc\") returned"
        )
    session = getattr(wrapper, SESSION_ATTR, None)
    if session is None or not session.records:
        name = getattr(wrapper, "compiler_name", "?")
        if name != "zeroc" and not str(name).startswith("zeroc"):
            raise ValueError(
                f"zeroc.explain: this object was compiled with backend={name!r}, not zeroc"
            )
        raise ValueError(
            "zeroc.explain: nothing has been compiled yet; torch.compile compiles on the "
            "first call, so call the compiled model once before explaining it"
        )
    return build_plan(session)


def _unique_params(session: CompileSession) -> tuple[ParamInfo, ...]:
    seen: dict[str, ParamInfo] = {}
    for record in session.records:
        for param in record.params:
            seen.setdefault(param.name, param)
    return tuple(seen.values())


def _world_mesh_zero(session: CompileSession) -> tuple[int, tuple[tuple[str, int], ...], int]:
    """World size, (pp, dp) mesh and ZeRO stage, read from the compiled graphs' markers.

    ZeRO stage -1 means the model was not parallelized (no ``zeroc.unshard`` markers).
    """
    zero = max((r.zero for r in session.records), default=-1)
    if zero < 0 or not dist.is_initialized():
        return 1, (), zero
    world = dist.get_world_size()
    group = resolve_group(session.records[0].zero_group)
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
    """Freeze a session's records into a Plan (single device: one stage, rank 0)."""
    zeroc_version, torch_version, triton_version = _versions()
    graphs = tuple(g for r in session.records for g in ([r.joint] if r.joint else []) + r.graphs)
    params = _unique_params(session)
    param_bytes = sum(p.bytes for p in params)
    forward_flops = sum(g.flops for g in graphs if g.kind in ("forward", "inference"))
    saved = sum(r.saved_bytes for r in session.records)
    activations = saved + max((r.transient_bytes for r in session.records), default=0)
    modules = tuple(dict.fromkeys(p.name.split(".")[0] for p in params))
    stage = StageInfo(index=0, modules=modules, params=sum(p.numel for p in params),
                      param_bytes=param_bytes, flops=forward_flops, activation_bytes=saved)
    collectives = tuple(c for r in session.records for c in r.collectives)
    layout = next((r.layout for r in session.records if r.layout is not None), None)
    if layout is None:
        held = (param_bytes, param_bytes, ADAM_STATES * param_bytes)
    else:
        held = layout.held_bytes(ADAM_STATES)
        collectives += _step_collectives(layout)
    memory = MemoryEstimate(
        rank=layout.mesh.rank if layout is not None else 0,
        params=held[0], grads=held[1], optimizer=held[2], activations=activations,
        peak=sum(held) + activations,
        moved=sum(c.bytes for c in collectives if c.graph.endswith((".forward", ".backward"))
                  or c.graph == "optimizer.step"),
    )
    graph_hash = hashlib.sha256(
        "\n".join(g.code for g in graphs if g.kind != "joint").encode()).hexdigest()[:16]
    config = session.config
    devices = {str(r.device) for r in session.records}
    world, mesh, zero = _world_mesh_zero(session)
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
    )
    plan = Plan(
        meta=meta,
        graphs=graphs,
        stages=(stage,),
        params=params,
        kernels=tuple(k for r in session.records for k in r.kernels),
        collectives=collectives,
        memory=(memory,),
        passes=tuple(p for r in session.records for p in r.passes),
    )
    pipeline = getattr(session, "pipeline", None)
    if pipeline is not None:  # pp > 1: stages, schedule grid and measured step
        from zeroc.pipeline_plan import pipeline_plan

        plan = pipeline_plan(plan, pipeline)
    return plan
