"""Hugging Face models built on the meta device, parallelized on 2 gloo ranks.

``zeroc.parallelize`` materializes one module at a time with the model's own initializer
(``_init_weights``) and keeps only this rank's rows: the full state equals the same model built
on the CPU under the same seed, the model trains compiled, and a rank's peak RSS during
``parallelize`` stays well below the model's full bytes. At pp=2 a meta Llama holds no parameter
bytes until the pipeline compiles; then each rank initializes only its stages' parameters, to
the CPU build's values.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks

transformers = pytest.importorskip("transformers")


def tiny_llama(hidden: int = 32, layers: int = 2, vocab: int = 96):
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config)


def tiny_gpt2():
    config = transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2,
                                     n_head=4, use_cache=False)
    config._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(config)


FACTORIES = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def _built(name: str, meta: bool):
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return FACTORIES[name]()
    return FACTORIES[name]()


def _rss_high_water_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))


def meta_job(rank: int, world: int) -> dict:
    import zeroc

    out: dict = {}
    for name in FACTORIES:
        torch._dynamo.reset()
        model = zeroc.parallelize(_built(name, meta=True), zero=3)
        out[name] = {"full": zeroc.full_state_dict(model)}
        compiled = torch.compile(model, backend="zeroc")
        tokens = torch.arange(16).view(2, 8) % 96 + rank
        loss = compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()
        out[name]["loss"] = loss.item()
        out[name]["grads"] = all(p.grad is not None for p in model.parameters())
    # Peak RSS while parallelizing a ~25M-parameter meta Llama (100 MB in fp32).
    with torch.device("meta"):
        big = tiny_llama(hidden=512, layers=6, vocab=8192)
    full_bytes = sum(p.numel() * 4 for p in big.parameters())
    before = _rss_high_water_kib()
    zeroc.parallelize(big, zero=3)
    out["rss_growth"] = (_rss_high_water_kib() - before) * 1024
    out["full_bytes"] = full_bytes
    return out


@pytest.fixture(scope="module")
def meta_ranks() -> list[dict]:
    return run_ranks(meta_job, 2, timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(500)
@pytest.mark.parametrize("name", list(FACTORIES))
def test_meta_built_hf_model_equals_cpu_built(meta_ranks, name: str) -> None:
    reference = _built(name, meta=False).state_dict()
    full = meta_ranks[0][name]["full"]
    assert set(full) == set(reference)
    for key, value in reference.items():
        assert torch.equal(full[key], value), key
    for result in meta_ranks:
        assert result[name]["grads"] and torch.isfinite(torch.tensor(result[name]["loss"]))


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_each_rank_materializes_only_its_shards(meta_ranks) -> None:
    for result in meta_ranks:
        print(f"peak RSS growth {result['rss_growth'] / 2**20:.0f} MiB for a model of "
              f"{result['full_bytes'] / 2**20:.0f} MiB")
        # Half the model (this rank's rows) plus one module's full tensors at a time.
        assert result["rss_growth"] < 0.8 * result["full_bytes"], result


def pipeline_meta_job(rank: int, world: int) -> dict:
    """A meta Llama at pp=2: no parameter bytes until the pipeline compiles, then only this
    rank's stages, initialized to the values a CPU build under the same seed has."""
    import zeroc

    torch._dynamo.reset()
    model = zeroc.parallelize(_built("llama", meta=True), zero=3, pp=2)
    state = model._zeroc_state
    before = sum(s.flat.untyped_storage().nbytes() for s in state.params)
    compiled = torch.compile(model, backend="zeroc", options={"schedule": "1f1b",
                                                              "microbatches": 2})
    tokens = torch.arange(32).view(4, 8) % 96
    loss = compiled(input_ids=tokens, labels=tokens).loss
    loss.backward()
    held = [s.record.param_name for s in state.params if s.held]
    after = sum(s.flat.untyped_storage().nbytes() for s in state.params)
    return {"before": before, "after": after, "loss": loss.item(), "held": held,
            "full_bytes": sum(s.flat.numel() * 4 for s in state.params),
            "full": zeroc.full_state_dict(model)}


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_meta_llama_in_a_pipeline_initializes_only_its_stages() -> None:
    results = run_ranks(pipeline_meta_job, 2, timeout=400)
    reference = _built("llama", meta=False)
    tokens = torch.arange(32).view(4, 8) % 96
    want = reference(input_ids=tokens, labels=tokens).loss.item()
    for result in results:
        assert result["before"] == 0, result["before"]
        assert 0 < result["after"] < 0.75 * result["full_bytes"], result
        assert abs(result["loss"] - want) < 1e-5, (result["loss"], want)
    assert set(results[0]["held"]) | set(results[1]["held"]) == set(
        dict(reference.named_parameters()))
    assert not set(results[0]["held"]) & set(results[1]["held"]) - {"model.embed_tokens.weight"}
    for key, value in reference.state_dict().items():
        assert torch.equal(results[0]["full"][key], value), key
