"""A small GPT-style decoder for the demo: byte tokens in, next-byte loss out.

Token + learned position embeddings, pre-LayerNorm transformer blocks (causal self-attention through
``scaled_dot_product_attention`` and a GELU MLP), a final LayerNorm and an LM head tied to the token
embedding. Small enough to train visibly on two CPU cores in a minute or two, and an ordinary
``nn.Module``, so the demo exercises the engine the way any user model would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    context_length: int = 128
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "n_layer", "d_model", "n_head", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.d_model {self.d_model} must be divisible by n_head {self.n_head} "
                "(each head gets d_model / n_head channels)"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


# For the end-to-end test and quick smoke runs: trains in seconds.
TINY_CONFIG = GPTConfig(context_length=64, n_layer=2, d_model=64, n_head=2)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=-1)
        # (batch, time, channels) -> (batch, heads, time, head_dim), the layout SDPA expects
        q, k, v = (t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(attended.transpose(1, 2).reshape(batch, time, channels))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.up = nn.Linear(config.d_model, hidden)
        self.proj = nn.Linear(hidden, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-LN residual block: normalising the branch input (not the sum) keeps deep stacks stable."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_attn(x)))
        return x + self.dropout(self.mlp(self.ln_mlp(x)))


class GPT(nn.Module):
    """``model(tokens)`` → logits (batch, time, vocab); ``model(tokens, targets)`` → mean cross-entropy."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.context_length, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_final = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # tied: one matrix reads and writes tokens
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # Each block adds two branches to the residual stream; shrinking the branches' output projections
        # keeps the stream's variance from growing with depth at initialisation.
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # the tied matrix is counted once

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        time = tokens.shape[-1]
        if time > self.config.context_length:
            raise ValueError(f"sequence length {time} exceeds the model's context_length {self.config.context_length}")
        positions = torch.arange(time, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_final(x))
        if targets is None:
            return logits
        # Cross-entropy in fp32 even under bf16: the log-softmax over 256 classes is where precision matters.
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
