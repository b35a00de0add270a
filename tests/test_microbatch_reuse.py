"""The micro-batch graph reuses the micro-batch propagation of ``specialize``.

A pipeline's dynamic Dynamo graph is specialized at the micro-batch size (fake values of every
node, and their costs), run through the passes, and handed to ``microbatch_graph``, which
needs every node's fake value and cost again. The nodes the passes left as they were keep
what the specialized run gave; only the changed ones run again. The result must be what
running every node again gives: the same costs, value shapes and batch dependence, and so the
same plan.
"""

from __future__ import annotations

import pytest
import torch
from models.gpt import GPT, GPTConfig

import zeroc
import zeroc.passes.front.microbatch_shapes as microbatch_shapes
import zeroc.world.plan_workers as plan_workers


# Two blocks, one per stage of the pp=2 plans below (Dynamo's trace grows with the blocks).
def _llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _gpt() -> torch.nn.Module:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32), seed=1)


def _inputs(name: str):
    tokens = torch.zeros(4, 16, dtype=torch.long)
    return {"input_ids": tokens, "labels": tokens} if name == "llama" else (tokens, tokens)


def _plan(monkeypatch: pytest.MonkeyPatch, name: str, reuse: bool):
    """The plan at world 4, pp 2, and what each ``microbatch_graph`` call gave and ran."""
    calls = []
    build = microbatch_shapes.shrink_to_microbatch

    def spy(gm, *args, **kwargs):
        runs = []
        init = microbatch_shapes.CostMode.__init__

        def counting(self) -> None:
            runs.append(1)
            init(self)

        with monkeypatch.context() as patch:
            patch.setattr(microbatch_shapes.CostMode, "__init__", counting)
            if not reuse:
                patch.setattr(microbatch_shapes, "_specialized_mode", lambda gm: None)
            mgraph = build(gm, *args, **kwargs)
        shapes = {k: (tuple(v.shape), v.dtype, v.requires_grad)
                  for k, v in mgraph.values.items() if isinstance(v, torch.Tensor)}
        calls.append({"costs": mgraph.costs, "shapes": shapes,
                      "dependent": mgraph.batch_dependent, "ran": len(runs),
                      "nodes": len(mgraph.costs)})
        return mgraph

    with monkeypatch.context() as patch:
        patch.setattr(microbatch_shapes, "shrink_to_microbatch", spy)
        patch.setattr(plan_workers, "planning_cores", lambda: 1)
        model = _llama() if name == "llama" else _gpt()
        plan = zeroc.explain(model, _inputs(name), world=4, pp=2, zero=3, device="cpu",
                             options={"schedule": "1f1b", "microbatches": 2})
    return plan, calls


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_reused_values_and_costs_equal_a_full_run(monkeypatch, name: str) -> None:
    reused, reused_calls = _plan(monkeypatch, name, True)
    full, full_calls = _plan(monkeypatch, name, False)
    assert len(reused_calls) == len(full_calls) == 1
    mine, want = reused_calls[0], full_calls[0]
    for key in ("costs", "shapes", "dependent"):
        assert mine[key] == want[key], key
    assert want["ran"] == want["nodes"]
    # Only what the passes changed runs again (the loss, rewritten to a sum).
    assert mine["ran"] <= max(2, want["nodes"] // 20), (mine["ran"], want["nodes"])
    assert str(reused) == str(full)
    assert reused.memory == full.memory
