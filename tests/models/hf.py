"""Hugging Face ``transformers`` models built from small configs, for the pipeline tests.

Ten architectures (decoder-only, encoder-only and encoder-decoder, ``ARCHITECTURES``), the
newer dense decoders Qwen3 and Gemma3 (``DENSE``), BART (``TIED``: one embedding tied to
four modules) and five mixture-of-experts decoders (``MOE``: GPT-OSS with 3-D expert weights
and biases, Mixtral, Qwen3-MoE with the router's auxiliary loss in the loss, OLMoE and
DeepSeek-V3 with a shared expert and a dense first layer), each with repeated blocks (four
unless asked; T5 and BART have half in the encoder and half in the decoder), a vocabulary of
``VOCAB`` tokens and dropout off, so a pipelined run can be compared with eager exactly. The
MoE models have ``EXPERTS`` experts per layer, ``TOP_K`` of them per token. ``build(name)``
makes one under the current torch RNG; ``UserWrapper`` is the way users often hold one: their
own module whose forward calls the model with ``labels=`` and returns ``.loss``.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 128
ARCHITECTURES = ("gpt2", "llama", "mistral", "qwen2", "gemma", "phi", "gpt_neox", "opt",
                 "bert", "t5")
DENSE = ("qwen3", "gemma3")
MOE = ("gpt_oss", "mixtral", "qwen3_moe", "olmoe", "deepseek_v3")
# Models whose embedding is tied to more than one module: BART's ``model.shared`` (never called
# itself) is its encoder's and decoder's embedding and its ``lm_head``.
TIED = ("bart",)
EXPERTS = 4
TOP_K = 2
# Rotary embeddings without scaling (GPT-OSS defaults to YaRN for 4096 original positions).
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _decoder(transformers, name: str, layers: int):
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                 num_attention_heads=2, max_position_embeddings=64, vocab_size=VOCAB)
    if name == "llama":
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(num_key_value_heads=1, **small))
    if name == "mistral":
        return transformers.MistralForCausalLM(
            transformers.MistralConfig(num_key_value_heads=1, **small))
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(num_key_value_heads=1, **small))
    if name == "gemma":
        return transformers.GemmaForCausalLM(
            transformers.GemmaConfig(num_key_value_heads=1, head_dim=16, **small))
    if name == "phi":
        return transformers.PhiForCausalLM(transformers.PhiConfig(
            resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, **small))
    if name == "gpt_neox":
        return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            hidden_dropout=0.0, attention_dropout=0.0, **small))
    if name == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **small))
    if name == "qwen3":
        return transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(num_key_value_heads=1, head_dim=16, **small))
    if name == "gemma3":
        # Sliding and full attention layers alternate; the window (8) is shorter than the
        # tests' sequences (16), so the sliding mask matters.
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2)
            + ["sliding_attention"] * (layers % 2), **small))
    return _mixture_of_experts(transformers, name, layers, small)


def _mixture_of_experts(transformers, name: str, layers: int, small: dict):
    moe = dict(small, num_key_value_heads=1, num_experts_per_tok=TOP_K)
    if name == "gpt_oss":
        # Experts as 3-D weights with biases (gate_up_proj_bias, down_proj_bias).
        return transformers.GptOssForCausalLM(transformers.GptOssConfig(
            num_local_experts=EXPERTS, head_dim=16, sliding_window=8, rope_parameters=_ROPE,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2)
            + ["sliding_attention"] * (layers % 2), **moe))
    if name == "mixtral":
        return transformers.MixtralForCausalLM(
            transformers.MixtralConfig(num_local_experts=EXPERTS, **moe))
    if name == "qwen3_moe":
        # The router's load-balancing loss is part of the loss.
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            num_experts=EXPERTS, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True,
            output_router_logits=True, router_aux_loss_coef=0.1, **moe))
    if name == "olmoe":
        return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            num_experts=EXPERTS, eos_token_id=None, **moe))
    if name == "deepseek_v3":
        # Multi-head latent attention, one dense layer, then routed experts with a shared one;
        # experts in 2 groups, the top 1 group's experts considered per token.
        return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            n_routed_experts=EXPERTS, n_shared_experts=1, moe_intermediate_size=32,
            first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, rope_parameters=_ROPE,
            **moe))
    return None


def build(name: str, layers: int = 4) -> nn.Module:
    """A small ``name`` model (one of ``ARCHITECTURES``, ``DENSE`` or ``MOE``) with ``layers``
    blocks (T5: half in the encoder, half in the decoder)."""
    import transformers

    model = _decoder(transformers, name, layers)
    if model is not None:
        return model
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=32, n_layer=layers, n_head=2, n_positions=64, vocab_size=VOCAB,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if name == "opt":
        return transformers.OPTForCausalLM(transformers.OPTConfig(
            hidden_size=32, ffn_dim=64, num_hidden_layers=layers, num_attention_heads=2,
            max_position_embeddings=64, vocab_size=VOCAB, word_embed_proj_dim=32, dropout=0.0,
            attention_dropout=0.0))
    if name == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            d_model=32, d_ff=64, num_layers=layers // 2, num_decoder_layers=layers // 2,
            num_heads=2, d_kv=16,
            vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    if name == "bart":
        return transformers.BartForConditionalGeneration(transformers.BartConfig(
            d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layers=layers // 2,
            decoder_layers=layers // 2, encoder_attention_heads=2, decoder_attention_heads=2,
            max_position_embeddings=64, vocab_size=VOCAB, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0))
    raise KeyError(f"unknown architecture {name!r}; known: "
                   f"{ARCHITECTURES + DENSE + MOE + TIED}")


class UserWrapper(nn.Module):
    """A user's module around a Hugging Face model: returns the model's ``.loss``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def token_batch(batch: int = 8, seq: int = 16, seed: int = 0,
                ignored: float = 0.0) -> tuple[torch.Tensor, ...]:
    """``(input_ids, labels)``: random tokens, the labels a copy of the inputs.

    ``ignored``: the fraction of labels set to ``-100`` at random, so micro-batches hold
    different numbers of counted tokens (a token mean must divide by the whole batch's count).
    """
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    labels = ids.clone()
    if ignored:
        labels[torch.rand(batch, seq, generator=generator) < ignored] = -100
    return ids, labels
