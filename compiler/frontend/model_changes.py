"""Changes to a model after ``zeroc.parallelize``: honoured at the next step, or refused by name.

``parallelize`` replaces every parameter by a flat buffer (what the graphs read and autograd
differentiates) and a visible parameter (what the user, optimizers and state dicts see; see
``zeroc.sharding.sharded_params``). A change made to the model afterwards reaches only the visible
side unless zeroc carries it over, so each kind of change is either carried over or refused:

- ``requires_grad``: FSDP2's behaviour. A parameter frozen after ``parallelize`` gets no
  gradient from the next step on (its ``.grad`` stays ``None`` after ``zero_grad``, so
  optimizers skip it and it is never reduced); one unfrozen gets its gradient, reduced over
  the data-parallel ranks, from the next step on. A forward pre-hook of the parallelized
  model (``sync_requires_grad``) copies each visible parameter's flag to its flat buffer
  before Dynamo checks its guards; Dynamo guards ``requires_grad`` of its graph inputs, so the
  changed flag recompiles the graphs (with ``pp > 1``, the pipeline, with the same split).
  Where that hook does not run first (the model called from inside a compiled function,
  whose guards are checked before the inlined hook), the graph compiled or run with the
  stale flag applies it (``check_requires_grad``), so the next call recompiles: a freeze is
  honoured in that step already, an unfreeze raises ``ModelChangedError`` naming the
  parameter (that step would not train it).
- Assigning, deleting or registering again a parallelized parameter
  (``module.weight = nn.Parameter(...)``, ``del module.weight``,
  ``module.register_parameter("weight", ...)``) raises at once, naming it (``guard_methods``):
  the graphs would keep reading the old flat buffer.
- A parameter that ``parallelize`` did not shard (a module added later with ``add_module`` or
  an attribute, a parameter registered later) and that a compiled graph of a parallelized model
  reads raises when that graph compiles (``check_graph_parameters``), naming it and saying to
  call ``zeroc.parallelize`` on the model built with it: it would be a plain tensor whose
  gradient is never averaged, so the replicas would drift apart.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from zeroc.runtime import torch_compat
from zeroc.runtime.errors import ModelChangedError
from zeroc.runtime.torch_compat import current_translator
from zeroc.sharding import offload
from zeroc.sharding.sharded_params import ShardedParam, ZeroState
from zeroc.sharding.whole_rows import refresh_stale

__all__ = ["ModelChangedError", "check_graph_parameters", "check_requires_grad",
           "install", "sync_requires_grad", "watch_requires_grad"]

log = logging.getLogger(__name__)

LAYOUT_ATTR = "_zeroc_layout"  # zeroc.parallelize: the model's and every flat buffer's layout
PARAM_ATTR = "_zeroc_param"  # zeroc.parallelize: a flat buffer's ParamShard
FLAT_SHARDED_ATTR = "_zeroc_flat_of"  # zeroc.sharding.stage_holding: a flat buffer's ShardedParam


def _apply(sharded: ShardedParam, state: ZeroState) -> None:
    """Give ``sharded``'s flat buffer its visible parameter's ``requires_grad``."""
    flag = sharded.visible.requires_grad
    sharded.flat.requires_grad_(flag)
    if flag:
        sharded.hook_flat()
    sharded.sink = None
    if flag and not state.requires_gradient_sync and state.pp == 1:
        sharded.open_sink(state)  # accumulating without sync: this one accumulates too
    sharded.record = dataclasses.replace(sharded.record, requires_grad=flag)
    setattr(sharded.flat, PARAM_ATTR, sharded.record)


def _stale(params: Iterable[ShardedParam]) -> list[ShardedParam]:
    return [s for s in params if s.visible.requires_grad != s.flat.requires_grad]


def sync_requires_grad(model: nn.Module, state: ZeroState) -> list[str]:
    """Copy every visible parameter's ``requires_grad`` to its flat buffer; the names changed.

    The model's layout (and each flat buffer's) is replaced by one with the new flags, so the
    plan's memory figures follow."""
    changed = _stale(state.params)
    if not changed:
        return []
    for sharded in changed:
        _apply(sharded, state)
    layout = model.__dict__.get(LAYOUT_ATTR)
    if layout is not None:
        layout = dataclasses.replace(layout, params=tuple(s.record for s in state.params))
        model.__dict__[LAYOUT_ATTR] = layout
        for sharded in state.params:
            setattr(sharded.flat, LAYOUT_ATTR, layout)
    names = [s.record.name for s in changed]
    log.info("zeroc: requires_grad changed after parallelize for %s: applied from this step "
             "(the compiled graphs recompile)", ", ".join(names))
    return names


@torch.compiler.disable  # called by the hook's eager frame, whose callees Dynamo would compile
def _sync(module: nn.Module) -> None:
    state = module.__dict__.get("_zeroc_state")
    if state is not None:
        sync_requires_grad(module, state)
        layout = module.__dict__.get(LAYOUT_ATTR)
        if layout is not None and layout.zero == 1:  # rows loaded since the last gather
            refresh_stale(state.params, "before the forward")
        if layout is not None and layout.offload is not None:  # rows loaded on the host
            offload.refresh_stale(state.params, "before the forward")


# The file of ``nn.Module.__call__``: a frame Dynamo compiles from there is a module's own call.
_MODULE_CALL_FILE = nn.Module._call_impl.__code__.co_filename


@torch.compiler.assume_constant_result
def _skip_if_called_by_the_module() -> bool:
    """While Dynamo traces the hook: run it eagerly instead when it is called by the model's
    own call, not inlined into a user's function that calls the model.

    ``torch.compile(model)`` runs the module's call eagerly and compiles each Python frame it
    enters, the hooks' too: Dynamo is told to skip the hook's frame (so the hook runs eagerly,
    before the forward's guards are checked; also with ``fullgraph=True``). Inlined into a
    user's function the hook traces to nothing, without a graph break."""
    root = getattr(getattr(current_translator(), "output", None), "root_tx", None)
    code = getattr(root, "f_code", None)
    if code is not None and (code is _sync_hook.__code__
                             or code.co_filename == _MODULE_CALL_FILE):
        raise torch_compat.SkipFrame("zeroc applies requires_grad changes before the forward")
    return False


def _sync_hook(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of a parallelized model: apply ``requires_grad`` changes (eagerly:
    see ``_skip_if_called_by_the_module``; what a compiled function's trace misses,
    ``check_requires_grad`` refuses)."""
    if not torch.compiler.is_compiling():
        _sync(module)
    else:
        _skip_if_called_by_the_module()


def install(model: nn.Module) -> None:
    """Register the ``requires_grad`` pre-hook on a parallelized model (first of its hooks)."""
    model.register_forward_pre_hook(_sync_hook, prepend=True)


def _graph_shards(example_inputs: list[Any]) -> list[ShardedParam]:
    return [s for v in example_inputs
            if isinstance(v, nn.Parameter) and (s := getattr(v, FLAT_SHARDED_ATTR, None))]


def check_requires_grad(params: list[ShardedParam], where: str) -> None:
    """Apply ``requires_grad`` changes that did not reach the flat buffers before Dynamo's
    guards (``sync_requires_grad`` did not run first: the model was called from inside a
    compiled function), so the next call recompiles with them.

    A parameter frozen since is right in this step too: it gets no gradient (autograd gives
    none to a buffer that does not require one now, and ``move_grad`` drops any). One
    unfrozen since would get none in this step: that raises, naming it."""
    stale = _stale(params)
    if not stale:
        return
    state = getattr(stale[0].flat, "_zeroc_state", None)
    unfrozen = [s.record.name for s in stale if s.visible.requires_grad]
    if state is not None:
        for sharded in stale:
            _apply(sharded, state)
    if not unfrozen:
        return
    raise ModelChangedError(
        f"zeroc: requires_grad of {', '.join(map(repr, unfrozen))} was set after "
        f"zeroc.parallelize and {where} without it: the model was called from inside a "
        "compiled function, so zeroc's pre-hook could not apply the change before Dynamo's "
        "guards. It is applied now, and the next call recompiles with it; compile the model "
        "itself (torch.compile(model)) to have such changes take effect at the next step"
    )


def check_graph_parameters(names: list[str], example_inputs: list[Any]) -> None:
    """Refuse a graph of a parallelized model that reads parameters ``parallelize`` did not
    shard (``names``: each input's readable name, in input order)."""
    if not _graph_shards(example_inputs):
        return
    foreign = [name for name, value in zip(names, example_inputs, strict=False)
               if isinstance(value, nn.Parameter) and not hasattr(value, FLAT_SHARDED_ATTR)]
    if foreign:
        listed = ", ".join(map(repr, foreign))
        raise ModelChangedError(
            f"zeroc: the compiled forward reads parameter(s) {listed} that zeroc.parallelize "
            "did not shard (added to the model after parallelize, e.g. with add_module or "
            "register_parameter): their gradients would never be averaged over the "
            "data-parallel ranks. Call zeroc.parallelize again after adding them: on the "
            "model built with them (a model is parallelized once)"
        )
    check_requires_grad(_graph_shards(example_inputs), "this graph was traced")


def watch_requires_grad(compiled: Callable[..., Any],
                        example_inputs: list[Any]) -> Callable[..., Any]:
    """``compiled``, checking on every call that no parameter it reads changed
    ``requires_grad`` unseen (``check_requires_grad``)."""
    params = _graph_shards(example_inputs)
    if not params:
        return compiled

    def run(*args: Any, **kwargs: Any) -> Any:
        check_requires_grad(params, "this step ran")
        return compiled(*args, **kwargs)

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True  # type: ignore[attr-defined]
    return run

