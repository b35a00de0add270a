"""The units a pipeline cuts between: the repeated blocks of a model, found at any depth.

Every traced node carries its module stack (``node.meta["nn_module_stack"]``, outermost
first: ``m``, ``m.model``, ``m.model.layers.2``, ``m.model.layers.2.mlp``). A *container* is a
module path whose children ``<path>.0``, ``<path>.1``, ... appear in the stacks; its children
are *blocks* when at least two of them exist and all have the same module type. The blocks of
the container that carries the most compute (``GPT2``'s ``transformer.h``, Llama's
``model.layers``, a plain ``layers`` list) are where stages are cut, and so are those of every
other container, outside it and not inside it, that carries at least ``OTHER_CONTAINER_SHARE``
of that compute: an encoder-decoder's ``model.encoder.layers`` and ``model.decoder.layers``
(BART) or ``encoder.block`` and ``decoder.block`` (T5). A container inside a block (a mixture
of experts' ``experts``) is never one.

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

__all__ = ["BlockLayout", "OTHER_CONTAINER_SHARE", "find_blocks", "module_stack"]

# A second container of blocks is cut too when it carries at least this share of the
# compute of the one that carries the most (an encoder beside a decoder).
OTHER_CONTAINER_SHARE = 0.1


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
    """The chosen containers, most compute first (empty when the model has no repeated
    blocks)."""

    containers: tuple[str, ...]

    def is_block(self, unit: str) -> bool:
        """True for a block of a container (``model.layers.3``)."""
        if not self.containers:
            return unit.rsplit(".", 1)[-1].isdigit()
        head, _, index = unit.rpartition(".")
        return head in self.containers and index.isdigit()

    def unit_of(self, node: torch.fx.Node) -> str | None:
        """The block or top-level module ``node`` belongs to (see the module docstring)."""
        stack = module_stack(node)
        if not self.containers:
            return stack[0][0] if stack else None
        for path, _ in stack:
            if self.is_block(path):
                return path
            if any(_encloses(path, c) for c in self.containers):
                continue  # a module around the blocks: look deeper
            return path
        return None


def find_blocks(nodes: Iterable[torch.fx.Node],
                cost: Callable[[torch.fx.Node], float]) -> BlockLayout:
    """Pick the containers of identical blocks where stages are cut (module docstring)."""
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
        return BlockLayout(containers=())
    # Most compute first; among equals, the shallower container.
    ranked = sorted(candidates, key=lambda h: (-totals[h], h.count(".")))
    chosen = [ranked[0]]
    for head in ranked[1:]:
        if totals[head] < OTHER_CONTAINER_SHARE * totals[ranked[0]]:
            break
        if not any(_encloses(head, c) or _encloses(c, head) for c in chosen):
            chosen.append(head)
    return BlockLayout(containers=tuple(chosen))
