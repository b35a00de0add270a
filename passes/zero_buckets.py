"""The ZeRO pass's shared pieces: its marker ops, buckets of marks, and parameter names.

``zeroc.passes.zero`` (gathers) and ``zeroc.passes.zero_reductions`` (gradient reductions)
pack marks of one key, in graph order, into buckets of at most ``cap`` bytes, never mixing
modules (``module_unit``), and name each mark by the parameter it stands for.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

import zeroc.runtime.zero_ops  # noqa: F401  (registers zeroc::unshard / reduce_grad)

aten = torch.ops.aten
prims = torch.ops.prims
UNSHARD = torch.ops.zeroc.unshard.default
REDUCE_GRAD = torch.ops.zeroc.reduce_grad.default
# Marks over a group of fewer ranks only reshape (a group of one moves nothing); the GPU check
# (benchmarks/gpu_checks/paths.py) sets 1 to run a world-1 group's collectives on one device.
# Read as ``zero_buckets.COLLECTIVE_MIN_RANKS`` at lowering time, so setting it here applies.
COLLECTIVE_MIN_RANKS = 2
ORDER = "_zeroc_order"  # node.meta key: the node's index in its graph while the pass runs


@dataclasses.dataclass
class Bucket:
    """Marks lowered together: their key (group, stage, dtype, ...), nodes and bytes."""

    key: tuple
    nodes: list[torch.fx.Node]
    nbytes: int


def buckets(nodes: Sequence[torch.fx.Node], key: Callable[[torch.fx.Node], Any],
            size: Callable[[torch.fx.Node], int], cap: int,
            joinable: Callable[[Bucket, torch.fx.Node], bool] = lambda b, n: True,
            ) -> list[Bucket]:
    """Pack ``nodes`` in order into buckets of one key and at most ``cap`` bytes each.

    ``joinable(bucket, node)`` may refuse a node that cannot share the open bucket.
    """
    open_buckets: dict[Any, Bucket] = {}
    done: list[Bucket] = []
    for node in nodes:
        k = key(node)
        bucket = open_buckets.get(k)
        if bucket is not None and (bucket.nbytes + size(node) > cap
                                   or not joinable(bucket, node)):
            done.append(bucket)
            bucket = None
        if bucket is None:
            bucket = open_buckets[k] = Bucket(k, [], 0)
        bucket.nodes.append(node)
        bucket.nbytes += size(node)
    done.extend(open_buckets.values())
    return sorted(done, key=lambda b: order(b.nodes[0]))


def order(node: torch.fx.Node) -> int:
    """``node``'s index in its graph, numbered by the pass before each lowering."""
    return node.meta[ORDER]


def gather_dtype(mark: torch.fx.Node) -> torch.dtype:
    """The dtype an unshard gathers in: its ``param_dtype`` argument, else the shard's."""
    param_dtype = mark.args[5] if len(mark.args) > 5 else mark.kwargs.get("param_dtype")
    return param_dtype or mark.args[0].meta["val"].dtype


def module_unit(name: str) -> str:
    """The module a parameter belongs to for bucketing: the first numbered block
    (``layers.3`` of ``layers.3.attn.qkv.weight``), else its top-level module (``tok_emb``).
    Buckets never mix units, so a ZeRO-3 gather holds one block at a time (as FSDP does)."""
    match = re.match(r"^(.*?\.\d+)(?:\.|$)", name)
    return match.group(1) if match else name.split(".")[0]


def grad_param_names(gm: torch.fx.GraphModule, names: dict[str, str]) -> dict:
    """reduce_grad node -> parameter name: output ``i`` of a backward graph is the gradient
    of the forward's input ``primals_{i+1}``."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    found = {}
    for index, value in enumerate(output.args[0]):
        if isinstance(value, torch.fx.Node) and value.target is REDUCE_GRAD:
            key = f"primals_{index + 1}"
            found[value] = names.get(key, key)
    return found


def param_name(node: torch.fx.Node, names: dict[str, str]) -> str:
    """The parameter an unshard reads: its shard argument traced back to a placeholder."""
    source = node.args[0]
    while isinstance(source, torch.fx.Node) and source.op != "placeholder" and source.args:
        source = source.args[0]
    name = source.name if isinstance(source, torch.fx.Node) else str(source)
    return names.get(name, name)
