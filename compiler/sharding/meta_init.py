"""Initialize a meta-device model one module at a time (used by ``zeroc.parallelize``).

``materialize_direct`` gives one module's direct meta parameters real, initialized, full-size
tensors (the caller shards them and frees them before the next module, so a rank never holds the
whole model) and replaces its meta buffers in place. A tensor is filled by the first of: the
user's ``init_fn(module)``; the model's per-module hook (Hugging Face ``_init_weights(module)``
of the nearest enclosing ``PreTrainedModel``, as HF's ``smart_apply`` dispatches it); the
module's ``reset_parameters()``; for rotary ``inv_freq`` buffers, the model's RoPE function.

Which one writes which tensor is found once by a dry run on meta tensors (no memory, no random
draws) under a dispatch mode that records the storages in-place ops write. The hook runs on a
*skeleton*, a shallow copy of the module tree with meta stand-ins for all tensors but, while a
module is filled, its scratch tensors: a parent's hook that re-initializes a child (GPT-2's
``GPT2Attention`` scales ``c_proj.weight``) is re-run for the child, touching nothing else.

Random stream: built on a real device, a model with a post-construction initializer draws in its
constructors, then in its init pass (HF: ``post_init`` at the end of each ``PreTrainedModel``'s
``__init__``). Before filling a module, the constructor draws that precede its init pass are
replayed into throw-away scratch tensors, one module at a time (``reset_parameters()``, else the
module's own initializer); tied parameters already materialized (``done``) are filled into
scratch too. So under the same ``torch.manual_seed`` the values equal a real-device build when its
init pass writes tensors in module order (true for HF Llama and GPT-2).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Container

import torch
from torch import nn

from zeroc.sharding.fake_params import active_fake_mode
from zeroc.sharding.meta_skeleton import WriteTracker, empty_like, skeleton, storage_id, swapped

__all__ = ["InitFn", "check_meta_initializable", "find_initializer",
           "materialize_direct"]

log = logging.getLogger(__name__)

InitFn = Callable[[nn.Module], None]

_PLAN_ATTR = "_zeroc_meta_init"
_STAGES = ("init_fn", "hook", "reset_parameters", "rope")  # who fills a tensor, first one wins
_ROPE_BUFFERS = ("inv_freq", "original_inv_freq")


def _own_hook(module: nn.Module) -> InitFn | None:
    """``module._init_weights`` / ``module.init_weights`` when it takes exactly one module."""
    for name in ("_init_weights", "init_weights"):
        fn = getattr(module, name, None)
        try:
            params = list(inspect.signature(fn).parameters.values()) if callable(fn) else []
        except (TypeError, ValueError):
            continue
        kinds = [p.kind for p in params if p.kind != p.VAR_KEYWORD]
        if len(kinds) == 1 and kinds[0] <= inspect.Parameter.POSITIONAL_OR_KEYWORD:
            return fn
    return None


def _is_hf_pretrained(module: nn.Module) -> bool:
    mro = type(module).__mro__
    return any(c.__name__ == "PreTrainedModel" and "transformers" in c.__module__ for c in mro)


class _ModelHook:
    """The model's per-module init hook; each module goes to its nearest enclosing HF model."""

    def __init__(self, model: nn.Module) -> None:
        self.root_fn = _own_hook(model)
        self.owner = {k: _own_hook(o) or self.root_fn for k, (o, _) in _walk(model)[2].items()}

    def __call__(self, module: nn.Module) -> None:
        fn = self.owner.get(id(module), self.root_fn)
        if fn is not None:
            with torch.no_grad():
                fn(module)


def find_initializer(model: nn.Module, init_fn: InitFn | None) -> InitFn | None:
    """How modules of ``model`` are (re)initialized: ``init_fn`` if given; else the model's own
    per-module hook (HF ``PreTrainedModel._init_weights(module)``, each module dispatched to its
    nearest enclosing ``PreTrainedModel``; a user model's ``_init_weights``/``init_weights`` that
    takes a module); else ``None`` (each module's ``reset_parameters()``)."""
    if init_fn is not None:
        return init_fn
    hook = _ModelHook(model)
    return hook if any(hook.owner.values()) else None


def _direct_meta(module: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """``(name, tensor, is_buffer)`` for ``module``'s direct meta parameters and buffers."""
    tables = ((module._parameters, False), (module._buffers, True))
    return [(n, t, b) for d, b in tables for n, t in d.items() if t is not None and t.is_meta]


def _rope_inv_freq(module: nn.Module) -> torch.Tensor | None:
    """``inv_freq`` as an HF rotary embedding computes it in ``__init__``, or ``None``."""
    config = getattr(module, "config", None)
    fn = getattr(module, "rope_init_fn", None)  # transformers 4.x keeps it on the module
    if fn is None and getattr(module, "rope_type", "default") == "default":
        fn = getattr(module, "compute_default_rope_parameters", None)
    return fn(config)[0] if config is not None and callable(fn) else None


_Tensors = dict[str, torch.Tensor]
_Chain = tuple[nn.Module, ...]
_Scope = dict[int, tuple[nn.Module, int]]  # id(module) -> (its init scope, see _walk)
_field = lambda factory: dataclasses.field(default_factory=factory)


@dataclasses.dataclass
class _Plan:
    """What initializes each module's meta tensors, found by a dry run on the meta model."""

    init_fn: InitFn | None
    nodes: dict[int, nn.Module]  # id(module) -> skeleton node
    hook: _ModelHook  # over the skeleton
    order: list[nn.Module]  # model.modules() order
    scope: _Scope
    block: set[int | None]  # storages of the model's real tensors (dry runs must not write them)
    writers: dict[int, list[nn.Module]]  # stand-in storage -> skeleton nodes whose hook writes it
    stages: dict[int, list[tuple[str, tuple[str, ...], _Chain]]] = _field(dict)
    uncovered: dict[int, tuple[str, ...]] = _field(dict)
    pending: set[int] = _field(set)
    replayed: int = 0  # modules whose constructor draws were replayed
    buffers: dict[int, torch.Tensor] = _field(dict)  # id(meta buffer) -> its real buffer


def _build_plan(model: nn.Module, init_fn: InitFn | None) -> _Plan:
    nodes = skeleton(model)
    pre, post, scope = _walk(model)
    block = {storage_id(t) for t in [*model.parameters(), *model.buffers()] if not t.is_meta}
    plan = _Plan(init_fn, nodes, _ModelHook(nodes[id(model)]), pre, scope, block, {})
    order = {id(nodes[id(m)]): i for i, m in enumerate(post)}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for node in (nodes[id(m)] for m in post) if any(plan.hook.owner.values()) else ():
            with WriteTracker() as tracker:
                _dry(plan.hook, node)
            for sid in tracker.written:
                plan.writers.setdefault(sid, []).append(node)
        for module in pre:
            metas = _direct_meta(module)
            if not metas:
                continue
            plan.pending.add(id(module))
            left = [n for n, _, _ in metas]
            for stage in _STAGES:
                covered, chain = _dry_stage(plan, stage, module, left)
                if covered:
                    chain = tuple(sorted(chain, key=lambda n: order[id(n)]))
                    plan.stages.setdefault(id(module), []).append((stage, covered, chain))
                    left = [n for n in left if n not in covered]
            if left:
                plan.uncovered[id(module)] = tuple(left)
    return plan


def _walk(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module], _Scope]:
    """Modules in pre- and post-order; per module its init scope (nearest enclosing HF model,
    else ``model``) and how many modules (in pre-order) are built before that scope's init."""
    pre: list[nn.Module] = []
    post: list[nn.Module] = []
    scope: dict[int, nn.Module] = {}
    end: dict[int, int] = {}

    def walk(module: nn.Module, owner: nn.Module) -> None:
        scope[id(module)] = module if module is model or _is_hf_pretrained(module) else owner
        pre.append(module)
        for child in module.children():
            if id(child) not in scope:
                walk(child, scope[id(module)])
        post.append(module)
        end[id(module)] = len(pre)

    walk(model, model)
    return pre, post, {key: (owner, end[id(owner)]) for key, owner in scope.items()}


def _dry(fn: Callable[..., object], *args: object) -> None:
    try:
        fn(*args)
    except Exception as exc:  # a dry run on meta tensors: report, do not fail
        log.warning("meta dry run of %s failed (%s: %s)", fn, type(exc).__name__, exc)


def _dry_stage(
    plan: _Plan, stage: str, module: nn.Module, names: list[str]
) -> tuple[tuple[str, ...], set[nn.Module]]:
    """The names among ``names`` that ``stage`` writes, and the skeleton nodes to run for them."""
    node = plan.nodes[id(module)]
    own = {n: t for n, t in {**node._parameters, **node._buffers}.items() if n in names}
    if stage == "hook":
        covered = tuple(n for n in names if storage_id(own[n]) in plan.writers)
        return covered, {w for n in covered for w in plan.writers[storage_id(own[n])]}
    if stage == "rope":
        ok = any(n in _ROPE_BUFFERS for n in names) and _rope_inv_freq(node) is not None
        return tuple(n for n in names if ok and n in _ROPE_BUFFERS), set()
    fn = plan.init_fn if stage == "init_fn" else getattr(node, "reset_parameters", None)
    if not callable(fn):
        return (), set()
    probe, target = {n: empty_like(t) for n, t in own.items()}, node
    if stage == "init_fn":
        fn, target = functools.partial(fn, module), module
    with swapped(target, probe), WriteTracker(plan.block) as tracker:
        _dry(fn)
    written = {n for n, t in probe.items() if storage_id(t) in tracker.written or not t.is_meta}
    return tuple(n for n in names if n in written), set()


def _plan_for(model: nn.Module, init_fn: InitFn | None) -> _Plan:
    plan = model.__dict__.get(_PLAN_ATTR)
    if plan is None or plan.init_fn is not init_fn:
        plan = model.__dict__[_PLAN_ATTR] = _build_plan(model, init_fn)
    return plan


def _message(path: str, module: nn.Module, name: str, is_buffer: bool) -> str:
    cls, where = type(module).__name__, f"{path}.{name}" if path else name
    return (
        f"{'buffer' if is_buffer else 'parameter'} {where!r} is on the meta device and nothing "
        f"initializes it (no init_fn, model init hook or reset_parameters() of module "
        f"{path or '<root>'!r} ({cls}) writes it): pass init_fn=... (init_fn(module) fills that "
        f"module's own parameters and buffers) or give {cls} a reset_parameters()"
    )


# Set on a planner's meta copy of a model that holds its values (built on the CPU or a GPU,
# ``zeroc.world.fake_world.meta_copy``): planning allocates fake tensors and never initializes,
# and the user's own model needs no initializer, so nothing is checked.
COPY_OF_VALUES_ATTR = "_zeroc_meta_copy_of_values"


def check_meta_initializable(model: nn.Module, init_fn: InitFn | None) -> None:
    """Raise ``ValueError`` naming the first module (dotted path and class) whose meta parameters
    or meta buffers nothing can initialize, saying what to pass (``init_fn=...``, or a
    ``reset_parameters()``). Call it before anything in ``model`` is sharded: it dry-runs the
    initializers on the meta model (``init_fn`` is called once per module on meta tensors)."""
    if model.__dict__.get(COPY_OF_VALUES_ATTR):
        return
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return
    plan = _plan_for(model, init_fn)
    seen: set[int] = set()
    for path, module in model.named_modules():
        for name, tensor, is_buffer in _direct_meta(module):
            if id(tensor) not in seen and name in plan.uncovered.get(id(module), ()):
                raise ValueError(_message(path, module, name, is_buffer))
            seen.add(id(tensor))


def _run(plan: _Plan, stage: str, module: nn.Module, tensors: _Tensors, chain: _Chain) -> None:
    """Fill ``tensors`` (scratch tensors standing for ``module``'s) by ``stage``; the hook runs
    on ``chain`` (skeleton nodes, in init-pass order)."""
    node = plan.nodes[id(module)]
    if stage == "rope":
        for t in tensors.values():
            t.copy_(_rope_inv_freq(node))
        return
    with swapped(module if stage == "init_fn" else node, tensors):
        if stage == "init_fn":
            plan.init_fn(module)
        elif stage == "reset_parameters":
            node.reset_parameters()
        else:
            for writer in chain:
                plan.hook(writer)


def _replay_construction(plan: _Plan, until: int, device: torch.device) -> None:
    """Draw what the constructors of the first ``until`` modules drew (into scratch)."""
    for module in plan.order[plan.replayed : until]:
        metas = _direct_meta(module)
        stages = [s for s, _, _ in plan.stages.get(id(module), ()) if s in ("init_fn", "hook")]
        if not stages or all(is_buffer for _, _, is_buffer in metas):
            continue  # no init pass re-draws it (or only buffers): it is filled in its turn
        tensors = {n: empty_like(t, device) for n, t, _ in metas}
        if callable(getattr(module, "reset_parameters", None)):
            stages = ["reset_parameters"]
        with torch.no_grad():
            _run(plan, stages[0], module, tensors, (plan.nodes[id(module)],))
    plan.replayed = max(plan.replayed, until)


def materialize_direct(
    model: nn.Module,
    module: nn.Module,
    device: torch.device,
    done: Container[int],
    init_fn: InitFn | None,
    skip_init: bool = False,
) -> dict[str, torch.Tensor]:
    """Full, initialized tensors for ``module``'s direct meta parameters (local name -> tensor on
    ``device``), excluding parameters whose id is in ``done`` (materialized through a tie).

    Nothing full-size stays registered on ``module`` (the caller shards and registers). Its meta
    buffers are replaced in place by real buffers on ``device`` (HF rotary ``inv_freq`` as the
    model computes it). Call it for every module in ``model.named_modules()`` order.
    ``skip_init``: a planned world's fake tensors (``PlannedWorld.skip_init``), made without
    running any initializer.
    """
    metas = _direct_meta(module)
    if not metas:
        return {}
    if skip_init:  # planning on fake tensors: shapes matter, values do not
        for name, tensor, is_buffer in metas:
            if is_buffer:
                module._buffers[name] = empty_like(tensor, device)
        # In the fake world only the shard is made (``parallelize``: on the planned device);
        # a full-size tensor there would stand for device memory no real rank needs.
        mode = active_fake_mode()
        return {n: torch.empty(t.shape, dtype=t.dtype, device=device if mode is None else "meta")
                for n, t, is_buffer in metas if not is_buffer and id(t) not in done}
    plan = _plan_for(model, init_fn)
    if any(s in ("init_fn", "hook") for s, _, _ in plan.stages.get(id(module), ())):
        _replay_construction(plan, plan.scope[id(module)][1], device)
    uncovered = plan.uncovered.get(id(module), ())
    for name, tensor, is_buffer in metas:
        if name in uncovered and id(tensor) not in done and id(tensor) not in plan.buffers:
            path = next(p for p, m in model.named_modules() if m is module)
            raise ValueError(_message(path, module, name, is_buffer))
    tensors = {
        n: empty_like(t, device)
        for n, t, is_buffer in metas
        if not (is_buffer and id(t) in plan.buffers) and n not in uncovered
    }
    with torch.no_grad():
        for stage, names, chain in plan.stages.get(id(module), ()):
            part = {n: tensors[n] for n in names if n in tensors}
            if part:
                log.debug("meta init %s %s by %s", type(module).__name__, list(part), stage)
                _run(plan, stage, module, part, chain)
                tensors.update(part)
    for name, tensor, is_buffer in metas:
        if is_buffer:
            module._buffers[name] = plan.buffers.setdefault(id(tensor), tensors.get(name, tensor))
    out = {n: tensors[n].detach() for n, t, is_buf in metas if not is_buf and id(t) not in done}
    plan.pending.discard(id(module))
    if not plan.pending:
        del model.__dict__[_PLAN_ATTR]
    return out
