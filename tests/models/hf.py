"""Hugging Face ``transformers`` models built from small configs, for the pipeline tests.

Ten architectures (decoder-only, encoder-only and encoder-decoder), each with repeated
blocks (four unless asked; T5 has half in the encoder and half in the decoder), a vocabulary
of ``VOCAB`` tokens and dropout off, so a pipelined run can be compared with eager exactly.
``build(name)`` makes one under the current torch RNG; ``UserWrapper`` is the way users
often hold one: their own module whose forward calls the model with ``labels=`` and returns
``.loss``.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 128
ARCHITECTURES = ("gpt2", "llama", "mistral", "qwen2", "gemma", "phi", "gpt_neox", "opt",
                 "bert", "t5")


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
    return None


def build(name: str, layers: int = 4) -> nn.Module:
    """A small ``name`` model (one of ``ARCHITECTURES``) with ``layers`` blocks (T5: half in
    the encoder, half in the decoder)."""
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
    raise KeyError(f"unknown architecture {name!r}; known: {ARCHITECTURES}")


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
