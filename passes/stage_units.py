"""The units a pipeline cuts between: the repeated blocks of a model, found at any depth.

Every traced node carries its module stack (``node.meta["nn_module_stack"]``, outermost
first: ``m``, ``m.model``, ``m.model.layers.2``, ``m.model.layers.2.mlp``). A *container* is a
module path whose children ``<path>.0``, ``<path>.1``, ... appear in the stacks; its children
are *blocks* when at least two of them exist and all have the same module type. The blocks of
the container that carries the most compute (``GPT2``'s ``transformer.h``, Llama's
``model.layers``, a plain ``layers`` list) are where stages are cut.

A node's unit is then its block (``m.model.layers.2``) or, outside every block, the first
module on its stack that does not enclose the container (``m.model.embed_tokens``,
``m.lm_head``). A node traced directly in a module that encloses the container (a mask or a
rotary table built in ``LlamaModel.forward``) has no unit and runs with its inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable

import torch.fx

__all__ = ["BlockLayout", "find_blocks", "module_stack"]


@functools.lru_cache(maxsize=4096)  # a model's few hundred paths, read once per node
def _normalize(path: str) -> str:
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"^L\['fn'\]\.?", "", path)
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", path)
    return path.lstrip(".")


def module_stack(node: torch.fx.Node) -> list[tuple[str, str]]:
    """``(dotted module path, module type name)`` of every module a node was traced in."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for path, kind in stack.values():
        name = _normalize(str(path))
        if name:
            out.append((name, getattr(kind, "__qualname__", str(kind))))
    return out


def _encloses(outer: str, inner: str) -> bool:
    return inner == outer or inner.startswith(outer + ".")


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """The chosen container (``None`` when the model has no repeated blocks)."""

    container: str | None

    def is_block(self, unit: str) -> bool:
        """True for a block of the container (``model.layers.3``)."""
        if self.container is None:
            return unit.rsplit(".", 1)[-1].isdigit()
        head, _, index = unit.rpartition(".")
        return head == self.container and index.isdigit()

    def unit_of(self, node: torch.fx.Node) -> str | None:
        """The block or top-level module ``node`` belongs to (see the module docstring)."""
        stack = module_stack(node)
        if self.container is None:
            return stack[0][0] if stack else None
        for path, _ in stack:
            if self.is_block(path):
                return path
            if _encloses(path, self.container):
                continue  # a module around the blocks: look deeper
            return path
        return None


def find_blocks(nodes: Iterable[torch.fx.Node],
                cost: Callable[[torch.fx.Node], float]) -> BlockLayout:
    """Pick the container of identical blocks that carries the most cost."""
    types: dict[str, dict[str, set[str]]] = {}
    totals: dict[str, float] = {}
    for node in nodes:
        seen: set[str] = set()
        for path, kind in module_stack(node):
            head, _, index = path.rpartition(".")
            if not index.isdigit() or head in seen:
                continue
            seen.add(head)
            types.setdefault(head, {}).setdefault(index, set()).add(kind)
            totals[head] = totals.get(head, 0.0) + cost(node)
    candidates = [
        head for head, blocks in types.items()
        if len(blocks) >= 2 and len({k for kinds in blocks.values() for k in kinds}) == 1
    ]
    if not candidates:
        return BlockLayout(container=None)
    # Most compute first; among equals, the shallower container.
    best = max(candidates, key=lambda h: (totals[h], -h.count(".")))
    return BlockLayout(container=best)
