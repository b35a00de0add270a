"""Repeated blocks traced once (``zeroc.frontend.block_regions``), as the shared planning trace
does.

With its blocks as nested compile regions, Dynamo traces a Hugging Face Llama and the zoo GPT
into ``invoke_subgraph`` calls; inlined, the graph must be the graph a plain trace gives: the
same ops in the same order on the same inputs, every node naming its own block in its module
stack. A region stamped out with a sibling block's parameters is refused, and the shared trace
then traces block by block.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from models.cnn import CNN, CNNConfig
from models.gpt import GPT, GPTConfig
from torch import nn

import zeroc
import zeroc.world.plan_capture as plan_capture
from zeroc.frontend.block_regions import blocks_traced_once, inline_block_regions, repeated_blocks
from zeroc.frontend.capture import source_name
from zeroc.passes.front.stage_units import module_stack
from zeroc.world.fake_world import _fake_inputs, fake_world, meta_copy, planned_world

pytestmark = pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"),
                                reason="this torch has no nested compile regions")


def _llama() -> tuple[nn.Module, dict]:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    tokens = torch.zeros(4, 16, dtype=torch.long)
    return model, {"input_ids": tokens, "labels": tokens}


def _gpt() -> tuple[nn.Module, tuple]:
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, d_model=32))
    tokens = torch.zeros(4, 16, dtype=torch.long)
    return model, (tokens, tokens)


def _trace(model: nn.Module, inputs, regions: bool, monkeypatch, edit=None):
    """The shared trace of ``model`` parallelized at pp=2 x dp=2, and how many block calls
    were inlined (``edit`` may change the region-traced graph before it is inlined)."""
    inlined = []

    def spy(gm, traced):
        if edit is not None:
            edit(gm)
        inlined.append(inline_block_regions(gm, traced))
        return inlined[-1]

    monkeypatch.setattr(plan_capture, "inline_block_regions", spy)
    with fake_world(0, 4, 2, "cpu"):
        planned = planned_world(0, 4, 2, "cpu")
        args, kwargs = _fake_inputs(inputs, planned.device)
        parallel = zeroc.parallelize(meta_copy(model), zero=3, pp=2, planned_world=planned)
        trace = plan_capture.SharedTrace()
        if regions:
            trace.trace(parallel, args, kwargs)
        else:
            trace._trace_once(parallel, args, kwargs, False)
    return trace, sum(inlined)


def _signature(gm: torch.fx.GraphModule) -> list[tuple]:
    """Each node's op, target, inputs (by position; a size input by its symbol) and
    module stack."""
    index: dict[torch.fx.Node, int] = {}
    symbol: dict[torch.fx.Node, str] = {}
    rows = []
    for position, node in enumerate(gm.graph.nodes):
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt) and value.node.expr.is_symbol:
            symbol[node] = str(value.node.expr)
        index[node] = position
        args = torch.fx.node.map_arg((node.args, node.kwargs),
                                     lambda n: symbol.get(n, f"%{index[n]}"))
        target = "input" if node.op == "placeholder" else str(node.target)
        rows.append((node.op, target, str(args), module_stack(node)))
    return rows


@pytest.mark.parametrize("build", [_llama, _gpt], ids=["hf-llama", "zoo-gpt"])
def test_regions_inline_to_the_plain_trace(build, monkeypatch) -> None:
    model, inputs = build()
    plain, _ = _trace(model, inputs, False, monkeypatch)
    regions, inlined = _trace(model, inputs, True, monkeypatch)
    assert inlined == 3  # every block's call went through a region
    assert regions.graphs == plain.graphs == 1 and regions.reusable
    assert _signature(regions.gm) == _signature(plain.gm)
    assert regions.places == plain.places
    blocks = {path for node in regions.gm.graph.nodes for path, _ in module_stack(node)
              if path.rsplit(".", 1)[-1].isdigit()}
    assert len(blocks) == 3


def test_a_region_given_a_sibling_blocks_parameter_is_refused(monkeypatch) -> None:
    """A stamped-out call reading block 0's parameter in block 1 fails the check; the shared
    trace then traces the blocks one by one (and still gives one graph)."""
    refused = []

    def misroute(gm: torch.fx.GraphModule) -> None:
        calls = [n for n in gm.graph.nodes if "invoke_subgraph" in str(n.target)]

        def param(call: torch.fx.Node, block: str) -> torch.fx.Node:
            return next(a for a in call.args if isinstance(a, torch.fx.Node)
                        and a.op == "placeholder" and source_name(a).startswith(block))

        calls[1].replace_input_with(param(calls[1], "layers.1."), param(calls[0], "layers.0."))

    def edit(gm: torch.fx.GraphModule) -> None:
        if any("invoke_subgraph" in str(n.target) for n in gm.graph.nodes):
            misroute(gm)
            try:
                inline_block_regions(gm, None)
            except ValueError as error:
                refused.append(str(error))
                raise

    model, inputs = _gpt()
    trace, inlined = _trace(model, inputs, True, monkeypatch, edit=edit)
    assert len(refused) == 1 and "(block layers.1) reads layers.0." in refused[0]
    assert inlined == 0 and trace.graphs == 1 and trace.reusable


def test_only_identical_siblings_are_blocks_and_classes_come_back() -> None:
    gpt = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, d_model=32))
    assert [len(group) for group in repeated_blocks(gpt)] == [3]
    cnn = CNN(CNNConfig())
    widths = {tuple(p.shape) for block in cnn.layers for p in block.parameters()}
    assert len(widths) > 1 and not any(
        group[0] in list(cnn.layers) for group in repeated_blocks(cnn))
    before = [type(block) for block in gpt.layers]
    with blocks_traced_once(gpt) as marked:
        assert marked == 3
        swapped = zip(gpt.layers, before, strict=True)
        assert all(type(b) is not t and isinstance(b, t) for b, t in swapped)
    assert [type(block) for block in gpt.layers] == before
    with contextlib.suppress(RuntimeError), blocks_traced_once(gpt):
        raise RuntimeError("a failed trace")
    assert [type(block) for block in gpt.layers] == before
