"""``zeroc.sharding.meta_init``: initialize a meta-device model one module at a time.

Hugging Face Llama and GPT-2 built under ``torch.device("meta")`` and materialized module by
module equal the same models built on the CPU under the same seed (parameters and buffers); a
user ``init_fn`` fills what the model cannot; a meta tensor nothing can fill is refused with the
module's path and class; materializing a ~200M-parameter Llama keeps peak RSS well below the
model's size (measured in a subprocess).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from zeroc.sharding.meta_init import check_meta_initializable, find_initializer, materialize_direct

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

CPU = torch.device("cpu")


def _llama(tie: bool = False) -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
        max_position_embeddings=64,
        use_cache=False,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config)


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=128,
        n_positions=64,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    return transformers.GPT2LMHeadModel(config)


def _on_meta(factory, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    with torch.device("meta"):
        return factory()


def _on_cpu(factory, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return factory()


def materialize_all(model: nn.Module, init_fn=None, seed: int | None = None) -> nn.Module:
    """Do what ``zeroc.parallelize`` does, keeping full tensors instead of shards (world = 1)."""
    check_meta_initializable(model, init_fn)
    if seed is not None:
        torch.manual_seed(seed)
    done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(original) -> (original, real)
    for _, module in list(model.named_modules()):
        before = dict(module._parameters)
        fresh = materialize_direct(model, module, CPU, done, init_fn)
        assert module._parameters == before, "full tensors must not be left on the module"
        assert all(not t.is_meta for t in fresh.values())
        for name, param in before.items():
            if param is None:
                continue
            if id(param) not in done:
                value = fresh[name] if param.is_meta else param.detach()
                assert value.shape == param.shape and value.dtype == param.dtype
                done[id(param)] = (param, nn.Parameter(value, param.requires_grad))
            module._parameters[name] = done[id(param)][1]
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    return model


def _assert_same_tensors(got: nn.Module, want: nn.Module) -> None:
    got_p, want_p = dict(got.named_parameters()), dict(want.named_parameters())
    assert got_p.keys() == want_p.keys()
    for name, value in want_p.items():
        assert torch.equal(got_p[name], value), name
    got_b = dict(got.named_buffers())
    for name, value in want.named_buffers():
        assert got_b[name].device == value.device and torch.equal(got_b[name], value), name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_equals_cpu_build(tie: bool) -> None:
    want = _on_cpu(lambda: _llama(tie))
    got = materialize_all(_on_meta(lambda: _llama(tie)))
    _assert_same_tensors(got, want)
    assert (got.lm_head.weight is got.model.embed_tokens.weight) == tie
    rotary = got.model.rotary_emb
    assert torch.equal(rotary.inv_freq, rotary.original_inv_freq)
    assert torch.equal(rotary.inv_freq, want.model.rotary_emb.inv_freq)
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(got(ids).logits, want(ids).logits, rtol=0, atol=0)


@pytest.mark.timeout(120)
def test_gpt2_equals_cpu_build_with_scaled_residual_init() -> None:
    want = _on_cpu(_gpt2)
    got = materialize_all(_on_meta(_gpt2))
    _assert_same_tensors(got, want)
    assert got.lm_head.weight is got.transformer.wte.weight
    # GPT2Attention/GPT2MLP re-initialize their child c_proj with std 0.02 / sqrt(2 * n_layer).
    for block in got.transformer.h:
        for parent in (block.attn, block.mlp):
            assert abs(parent.c_proj.weight.std().item() - 0.02 / math.sqrt(4)) < 0.002
            assert torch.count_nonzero(parent.c_proj.bias) == 0
        assert abs(block.attn.c_attn.weight.std().item() - 0.02) < 0.002
        assert torch.equal(block.ln_1.weight, torch.ones(64))


@pytest.mark.timeout(120)
def test_seed_changes_values_and_hf_hook_is_found() -> None:
    meta = _on_meta(_llama)
    hook = find_initializer(meta, None)
    assert hook is not None and find_initializer(meta, print) is print
    a = materialize_all(meta, seed=1)
    b = materialize_all(_on_meta(_llama), seed=2)
    assert not torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    for model in (a, b):  # same std as HF's own init; norms ones
        q = model.model.layers[0].self_attn.q_proj.weight
        assert abs(q.std().item() - 0.02) < 0.003 and abs(q.mean().item()) < 0.003
        assert torch.equal(model.model.norm.weight, torch.ones(64))


class _Flat(nn.Module):
    """A stand-in for zeroc's unshard parametrization; counts its evaluations."""

    calls = 0

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.shape = shape

    def forward(self, flat: torch.Tensor) -> torch.Tensor:
        _Flat.calls += 1
        return flat.view(self.shape)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("factory", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_sharded_modules_are_not_touched(factory) -> None:
    """Even when each module's parameters are flattened and parametrized right after it is
    materialized (the strictest order a caller can use), later modules' init hooks (GPT-2's
    parent hooks reach into their children) never evaluate those parametrizations."""
    from torch.nn.utils import parametrize

    model = _on_meta(factory)
    check_meta_initializable(model, None)
    entries: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    _Flat.calls = 0
    for _, module in list(model.named_modules()):
        fresh = materialize_direct(model, module, CPU, entries, None)
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in entries:
                flat = nn.Parameter(fresh[name].reshape(-1).clone(), param.requires_grad)
                entries[id(param)] = (param, flat)
            module._parameters[name] = entries[id(param)][1]
            parametrize.register_parametrization(module, name, _Flat(param.shape), unsafe=True)
    assert _Flat.calls == 0
    want = _on_cpu(factory)
    got = dict(model.named_parameters())
    for name, value in want.named_parameters():
        prefix, _, local = name.rpartition(".")
        key = f"{prefix}.parametrizations.{local}.original".lstrip(".")
        assert torch.equal(got[key].view(value.shape), value), name


class _Scale(nn.Module):
    """A parameter and a buffer directly on a module with no ``reset_parameters``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))
        self.register_buffer("mask", torch.tril(torch.ones(n, n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale) @ self.mask


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), _Scale(8)) for _ in range(2)])


def _fill_scale(module: nn.Module) -> None:
    if isinstance(module, _Scale):
        nn.init.constant_(module.scale, 2.0)
        module.mask.copy_(torch.tril(torch.ones_like(module.mask)))


@pytest.mark.timeout(60)
def test_user_init_fn_and_reset_parameters_fallback() -> None:
    assert find_initializer(_on_meta(_Net), None) is None
    want = _on_cpu(_Net)
    got = materialize_all(_on_meta(_Net), init_fn=_fill_scale)
    for i in range(2):
        block, ref = got.blocks[i], want.blocks[i]
        assert torch.equal(block[1].scale, torch.full((8,), 2.0))
        assert torch.equal(block[1].mask, ref[1].mask)
        # nn.Linear is not touched by the init_fn: its reset_parameters() fills it, with the
        # draws of a CPU construction.
        assert torch.equal(block[0].weight, ref[0].weight)
        assert torch.equal(block[0].bias, ref[0].bias)


@pytest.mark.timeout(120)
def test_user_init_fn_on_hf_model() -> None:
    def init_fn(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.1)

    want = _on_cpu(_llama)
    got = materialize_all(_on_meta(_llama), init_fn=init_fn)
    linear = got.model.layers[1].mlp.down_proj.weight
    assert abs(linear.std().item() - 0.1) < 0.01
    embed = got.model.embed_tokens.weight  # not handled by init_fn: the model's _init_weights
    assert abs(embed.std().item() - 0.02) < 0.003
    assert torch.equal(got.model.layers[0].input_layernorm.weight, torch.ones(64))
    assert torch.equal(got.model.rotary_emb.inv_freq, want.model.rotary_emb.inv_freq)


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(4))


class _WithMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mask", torch.ones(4))


@pytest.mark.timeout(60)
def test_uninitializable_meta_tensors_are_refused() -> None:
    model = _on_meta(lambda: nn.Sequential(nn.Linear(4, 4), nn.Sequential(_Gate())))
    pattern = (
        r"parameter '1\.0\.gate' is on the meta device.* module '1\.0' \(_Gate\).*"
        r"pass init_fn=\.\.\..*give _Gate a reset_parameters\(\)"
    )
    with pytest.raises(ValueError, match=pattern):
        check_meta_initializable(model, None)
    with pytest.raises(ValueError, match=pattern):
        for _, module in model.named_modules():
            materialize_direct(model, module, CPU, set(), None)
    # An init_fn that does not write the tensor does not help; one that does, does.
    with pytest.raises(ValueError, match=r"'1\.0' \(_Gate\)"):
        check_meta_initializable(model, lambda m: None)
    check_meta_initializable(model, lambda m: isinstance(m, _Gate) and m.gate.data.zero_())
    with pytest.raises(ValueError, match=r"buffer 'mask' is on the meta.*'<root>' \(_WithMask\)"):
        check_meta_initializable(_on_meta(_WithMask), None)


_RSS_SCRIPT = textwrap.dedent(
    """
    import torch, transformers
    from zeroc.sharding.meta_init import check_meta_initializable, materialize_direct
    torch.set_num_threads(1)
    def peak():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    config = transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=32000, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    check_meta_initializable(model, None)
    base, done, shards = peak(), set(), []
    for _, module in list(model.named_modules()):
        for name, tensor in materialize_direct(model, module, torch.device("cpu"), done,
                                               None).items():
            flat = tensor.reshape(-1)  # keep a 1/4 slice, as one rank of four would
            shards.append(flat[: (flat.numel() + 3) // 4].clone())
            del flat, tensor
            done.add(id(module._parameters[name]))
    kept = sum(s.numel() * s.element_size() for s in shards)
    print(full, peak() - base, kept)
    """
)


@pytest.mark.timeout(180)
def test_peak_rss_is_one_module_plus_shards() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # A fixed mmap threshold makes glibc return freed full tensors to the OS at once, so the
    # peak measures what is held, not heap fragmentation.
    env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    run = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT], env=env, capture_output=True, text=True, timeout=170
    )
    assert run.returncode == 0, run.stderr[-3000:]
    full, growth, kept = map(int, run.stdout.split()[-3:])
    assert full > 800e6  # ~220M fp32 parameters
    assert kept < 0.26 * full
    assert growth < 0.5 * full, (growth / full, kept / full)


class _Nano(nn.Module):
    """A user model with a nanoGPT-style ``_init_weights(module)`` applied in ``__init__``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(32, 16)
        self.blocks = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.Linear(64, 16))
        self.head = nn.Linear(16, 32, bias=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


@pytest.mark.timeout(60)
def test_user_model_init_weights_hook_equals_cpu_build() -> None:
    meta = _on_meta(_Nano)
    assert find_initializer(meta, None) is not None
    _assert_same_tensors(materialize_all(meta), _on_cpu(_Nano))


@pytest.mark.timeout(60)
def test_rotary_buffers_without_a_model_hook() -> None:
    """A rotary embedding outside any PreTrainedModel: inv_freq as its __init__ computes it."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _llama().config
    factory = lambda: nn.ModuleDict({"rope": LlamaRotaryEmbedding(config)})
    got = materialize_all(_on_meta(factory))
    _assert_same_tensors(got, _on_cpu(factory))
