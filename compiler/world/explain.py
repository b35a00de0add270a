"""``zeroc.explain``: the Plan of everything zeroc compiled for a model or function, or of a
job planned for a world that is not here."""

from __future__ import annotations

from typing import Any

from zeroc.frontend.session_plan import build_plan, session_of
from zeroc.runtime.plan.plan import Plan

__all__ = ["explain"]


def explain(compiled: Any, example_inputs: Any = None, *, world: int | None = None,
            pp: int = 1, zero: int = 3, device: str = "cuda", hardware: Any = None,
            options: dict | None = None, mixed_precision: Any = None,
            offload: str | None = None) -> Plan:
    """Return the Plan of what zeroc compiled for ``compiled``.

    ``compiled`` is what ``torch.compile(..., backend="zeroc")`` returned (a module or a
    function), a module after ``module.compile(backend="zeroc")``, or a model whose blocks
    were compiled one by one (one plan of every region, named by module path). Compilation
    is lazy: call it once before asking for its plan.

    With ``world=W``, plan a job that is not there instead: ``compiled`` is then the model
    (on the meta device or not; it is not changed) and ``example_inputs`` its inputs (a tuple,
    or a dict of keyword inputs); every pipeline position of a W-rank job with ``pp``
    positions and ZeRO stage ``zero`` runs one fake training step on ``device`` in this
    process (``zeroc.world.world_plan``). ``hardware``: a profile name or dict
    (``zeroc.runtime.cost.hardware``); ``options``: zeroc's compile options; ``offload``:
    ``parallelize``'s (``"optimizer"``: the plan's memory rows count the device and the host
    apart).
    """
    if world is not None:
        from zeroc.world.world_plan import plan_world

        return plan_world(compiled, example_inputs, world=world, pp=pp, zero=zero,
                          device=device, hardware=hardware, options=options,
                          mixed_precision=mixed_precision, offload=offload)
    return build_plan(session_of(compiled))
