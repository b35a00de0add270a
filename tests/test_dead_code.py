"""Dead-code elimination keeps random draws and drops unread seeded ops that draw nothing.

Attention ops are tagged ``nondeterministic_seeded`` for their dropout, so torch's own DCE
keeps an unread call even at ``dropout_p=0``; zeroc's pass drops it. An unread dropout with
``p > 0`` draws random numbers and must stay (removing it would shift later draws).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from zeroc.passes.base import PassContext
from zeroc.passes.dead_code import draws_no_random, eliminate_dead_code

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _graph(dropout_p: float) -> torch.fx.GraphModule:
    def body(q, k, v):
        FLASH(q, k, v, 0.0, True)  # unread: dead unless it draws random numbers
        F.dropout(q, 0.5, True)    # unread, but draws: must stay
        return q * 2

    q = torch.randn(1, 2, 8, 4)
    gm = make_fx(body)(q, q, q)
    # CPU flash attention cannot run dropout, so the graph is traced at 0 and edited.
    node = next(n for n in gm.graph.nodes if n.target == FLASH)
    node.args = (*node.args[:3], dropout_p, *node.args[4:])
    return gm


def _count(gm: torch.fx.GraphModule, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.target == target)


def _context() -> PassContext:
    return PassContext(config=None, graph_name="g0.backward", kind="backward")


def test_unread_attention_without_dropout_is_removed() -> None:
    gm = _graph(0.0)
    assert _count(gm, FLASH) == 1
    assert draws_no_random(next(n for n in gm.graph.nodes if n.target == FLASH))
    result = eliminate_dead_code(gm, _context())
    assert result.changed
    assert _count(result.gm, FLASH) == 0
    # The unread dropout with p=0.5 draws random numbers: it stays.
    kept = [n.target for n in result.gm.graph.nodes if n.op == "call_function"]
    assert any(torch.Tag.nondeterministic_seeded in t.tags for t in kept), kept


def test_unread_attention_with_dropout_stays() -> None:
    gm = _graph(0.1)
    node = next(n for n in gm.graph.nodes if n.target == FLASH)
    assert not draws_no_random(node)
    result = eliminate_dead_code(gm, _context())
    assert _count(result.gm, FLASH) == 1
