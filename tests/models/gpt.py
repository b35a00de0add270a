"""A GPT-style decoder: learned positions, pre-norm blocks, causal SDPA, tied embedding head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import init_parameters


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT: ``n_layer`` blocks of width ``d_model`` with ``n_head`` attention heads."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    d_model: int
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"GPTConfig: {name}={value!r} must be a positive integer")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} must be divisible by n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout={self.dropout!r} must be in [0, 1)")

    @staticmethod
    def tiny() -> GPTConfig:
        """The size the unit tests use: vocab 64, block 16, 2 layers, 2 heads, width 32."""
        return GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a fused ``qkv`` projection and causal SDPA."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape ``(batch, seq, d_model)``, each position to earlier ones."""
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        head_dim = width // self.n_head
        q = q.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        attn_dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=attn_dropout, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)
        return self.resid_drop(self.proj(y))


class FeedForward(nn.Module):
    """Linear (4x wider) -> GELU -> Linear -> dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the position-wise MLP."""
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``(batch, seq, d_model)``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``tok_emb``, ``pos_emb``, ``layers.{i}``, ``ln_f``, ``lm_head`` (tied to ``tok_emb``)."""

    def __init__(self, config: GPTConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.config = config if config is not None else GPTConfig.tiny()
        cfg = self.config
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        init_parameters(self, seed)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``, or the mean CE loss."""
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(
                f"GPT: sequence length {seq} exceeds block_size={self.config.block_size}"
            )
        positions = torch.arange(seq, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.layers:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    def example_batch(
        self, batch_size: int = 4, seq_len: int | None = None, seed: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A deterministic ``(tokens, next_tokens)`` pair of shape ``(batch_size, seq_len)``."""
        return random_token_batch(
            self.config.vocab_size, self.config.block_size, batch_size, seq_len, seed
        )


def random_token_batch(
    vocab_size: int, block_size: int, batch_size: int, seq_len: int | None, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and the same sequence shifted by one, as language-model inputs/targets."""
    seq = block_size if seq_len is None else seq_len
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
