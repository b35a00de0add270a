"""Take each parameter's ``zeroc::unshard`` out of a pipeline's graph: gathered once per step.

In a ZeRO model's Dynamo graph every read of a parameter is ``zeroc::unshard(shard, ...)``,
which the ZeRO lowering turns into an all-gather in the forward and a reduction of the
gradient in the backward. A pipeline runs each stage graph once per micro-batch, so those
collectives would run N times per step. With ``pp_reshard=False`` this pass removes the
unshard nodes whose input is a parameter placeholder: every use reads the placeholder
instead, which from now on stands for the *full* parameter (in ``param_dtype``), and whose
gradient the stage graphs return whole. The executor gathers and reduces once per step
(``runtime/pipeline/zero.py``) with what is returned here: a ``HoistedParam`` per parameter
input. An unshard of anything else stays in the graph. A pipeline opens no accumulation sink
(``zeroc.sharding.sharded_params``): its step keeps unsynchronised sums itself.

The stage graphs are then traced on fake full-size parameters of a fake tensor mode of their
own (``zeroc.pipeline.stage_trace``), never on tensors of the rank's device.

``hoist_unshards(gm, ctx)`` is the pass (``run_passes``, with a
``zeroc.passes.front.context.FrontContext``): ``remove_param_unshards`` in place with
``ctx.params`` and ``ctx.names``, the ``HoistedParam``s published as ``ctx.hoisted``. With
``pp_reshard=True`` it leaves the graph as it is: the stages gather for themselves.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

import zeroc.runtime.zero_ops  # noqa: F401  (registers zeroc::unshard)
from zeroc.passes.base import PassContext, PassResult
from zeroc.passes.front.context import front_context
from zeroc.passes.front.microbatch_shapes import HOISTED_VALUE, SPECIALIZED_RUN
from zeroc.runtime.pipeline.zero import HoistedParam

__all__ = ["hoist_unshards", "remove_param_unshards"]

UNSHARD = torch.ops.zeroc.unshard
_ARGS = ("shard", "shape", "numel", "group_name", "zero_stage", "param_dtype", "reduce_dtype")


def _arguments(node: torch.fx.Node) -> dict[str, Any]:
    values = dict(zip(_ARGS, node.args, strict=False))
    values.update(node.kwargs)
    for name in _ARGS[5:]:
        values.setdefault(name, None)
    return values


def hoist_unshards(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Pass: ``remove_param_unshards(gm, ctx.params, ctx.names)`` (in place) unless the config
    says ``pp_reshard``; publishes ``ctx.hoisted``."""
    front = front_context(ctx, "hoist_unshards")
    if ctx.config.pp_reshard:
        front.hoisted = {}
        return PassResult(gm, False, {"skipped": "pp_reshard=True: the stages gather"})
    front.hoisted = remove_param_unshards(gm, front.params, front.names)
    return PassResult(gm, bool(front.hoisted), {"hoisted": len(front.hoisted)})


def remove_param_unshards(gm: torch.fx.GraphModule, params: set[int],
                          names: list[str]) -> dict[int, HoistedParam]:
    """Remove the unshards of parameter placeholders from ``gm`` (in place); see above."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index_of = {n.name: i for i, n in enumerate(placeholders)}
    hoisted: dict[int, HoistedParam] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (UNSHARD, UNSHARD.default):
            continue
        args = _arguments(node)
        shard = args["shard"]
        index = index_of.get(shard.name) if isinstance(shard, torch.fx.Node) else None
        if index is None or index not in params:
            continue
        spec = HoistedParam(
            index=index, name=names[index], shape=tuple(int(s) for s in args["shape"]),
            numel=int(args["numel"]), group_name=args["group_name"],
            zero_stage=int(args["zero_stage"]), param_dtype=args["param_dtype"],
            reduce_dtype=args["reduce_dtype"])
        earlier = hoisted.get(index)
        if earlier is not None and (earlier.shape, earlier.param_dtype) != (
                spec.shape, spec.param_dtype):
            raise ValueError(f"zeroc pipeline: parameter {spec.name} is gathered as "
                             f"{earlier.shape} and as {spec.shape} in one graph")
        hoisted[index] = spec
        run = node.meta.get(SPECIALIZED_RUN)
        if run is not None:  # the placeholder now stands for what the gather gave
            shard.meta.setdefault(HOISTED_VALUE, run.out)
        node.replace_all_uses_with(shard)
        gm.graph.erase_node(node)
    gm.recompile()
    return hoisted
