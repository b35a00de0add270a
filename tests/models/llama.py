"""A Llama-style decoder: RMSNorm, rotary positions, causal SDPA, SwiGLU MLP, untied head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import init_parameters
from .gpt import random_token_batch


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a Llama: ``n_layer`` blocks of width ``d_model``, SwiGLU width ``ffn_hidden``."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    d_model: int
    ffn_hidden: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "ffn_hidden"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"LlamaConfig: {name}={value!r} must be a positive integer")
        if self.d_model % self.n_head != 0 or (self.d_model // self.n_head) % 2 != 0:
            raise ValueError(
                f"LlamaConfig: d_model={self.d_model} must be divisible by n_head={self.n_head} "
                "into an even head size (rotary embedding rotates pairs of features)"
            )
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError(
                f"LlamaConfig: rope_theta={self.rope_theta!r} and norm_eps={self.norm_eps!r} "
                "must be positive"
            )

    @staticmethod
    def tiny() -> LlamaConfig:
        """The size the unit tests use: vocab 64, block 16, 2 layers, 2 heads, width 32."""
        return LlamaConfig(
            vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32, ffn_hidden=64
        )


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x**2, -1) + eps) * weight``, computed in the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x``."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(head_dim: int, positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin tables ``(positions, head_dim)`` for the rotate-half rotary embedding."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate feature pairs ``(i, i + head_dim/2)`` of ``x (batch, heads, seq, head_dim)``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Multi-head causal self-attention with rotary embeddings on queries and keys."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.wq = nn.Linear(config.d_model, config.d_model, bias=False)
        self.wk = nn.Linear(config.d_model, config.d_model, bias=False)
        self.wv = nn.Linear(config.d_model, config.d_model, bias=False)
        self.wo = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attend over ``x (batch, seq, d_model)``; ``cos``/``sin`` are ``(seq, head_dim)``."""
        batch, seq, width = x.shape
        head_dim = width // self.n_head
        q = self.wq(x).view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).contiguous().view(batch, seq, width))


class SwiGLU(nn.Module):
    """``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.w3 = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated MLP."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """``x + attention(attention_norm(x))``, then ``x + feed_forward(ffn_norm(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.feed_forward = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``(batch, seq, d_model)``."""
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """``tok_emb``, ``layers.{i}``, ``norm``, ``lm_head``; rotary tables as buffers."""

    def __init__(self, config: LlamaConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.config = config if config is not None else LlamaConfig.tiny()
        cfg = self.config
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.d_model // cfg.n_head, cfg.block_size, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        init_parameters(self, seed)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``, or the mean CE loss."""
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(
                f"Llama: sequence length {seq} exceeds block_size={self.config.block_size}"
            )
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.tok_emb(idx)
        for block in self.layers:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
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
