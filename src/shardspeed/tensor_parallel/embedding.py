"""The vocabulary-parallel embedding (Megatron-LM's ``VocabParallelEmbedding``) and the tied LM head.

The embedding table ``[V, h]`` is split by rows: tensor rank ``r`` holds the rows of tokens
``[r·c, (r+1)·c)`` with ``c = ceil(V / TP)``. A lookup masks the tokens outside this rank's range (they give zero
rows) and the ranks' partial outputs are summed (``g``; under sequence parallelism reduce-scattered along the
sequence, ``ḡ``): one all-reduce of ``b·s·h`` in forward, none in backward.

[Note: vocabulary padding] The vocabulary is padded up to a multiple of TP so every rank holds exactly ``c`` rows
(equal-width logits from a tied head, equal bytes per rank). The padding rows are zero and never trained: no
valid token looks them up (a token id outside ``[0, V)`` is an error) and the vocab-parallel cross-entropy
excludes their logits, so their gradient is exactly zero and Adam/AdamW/SGD leave them at zero. The parameter's
spec keeps the *real* vocabulary as the global shape (``ParamSpec(padded=TP·c)``): the padding rows lie outside
every box, so checkpoints, consolidation and ``global_state_dict`` see exactly what a dense ``nn.Embedding``
holds, and a checkpoint taken at one TP degree loads at another (whose padding differs).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardspeed.params.spec import ParamSpec
from shardspeed.tensor_parallel.context import TensorParallel
from shardspeed.tensor_parallel.mappings import (
    copy_to_tensor_region,
    gather_from_sequence_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
)


def vocab_range(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int, int]:
    """``(start, real_end, padded_end)`` of the token ids tensor rank ``tp_rank`` holds: rows ``start..real_end``
    are real, ``real_end..padded_end`` padding (pure; ``c = ceil(V/TP)`` rows per rank)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor rank {tp_rank} outside a tensor axis of {tp_size}")
    chunk = math.ceil(vocab_size / tp_size)
    start = tp_rank * chunk
    return start, max(start, min(start + chunk, vocab_size)), start + chunk


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """``V`` rounded up to a multiple of ``tp_size``."""
    return math.ceil(vocab_size / tp_size) * tp_size


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim, padding_idx)`` split by rows over the tensor axis.

    Input: token ids ``[b, s]`` (identical on every tensor rank). Output: ``[b, s, h]`` replicated, or under
    ``tp.sequence_parallel`` split along ``sequence_dim`` (Megatron-SP: the embedding output is the first
    sequence-parallel activation). ``reset_parameters`` draws ``nn.Embedding``'s global N(0, 1) init and slices
    it, so under the same seed a sliced model starts equal to the dense one.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TensorParallel,
        *,
        padding_idx: int | None = None,
        sequence_dim: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if padding_idx is not None and not 0 <= padding_idx < num_embeddings:
            raise ValueError(f"padding_idx {padding_idx} outside the vocabulary [0, {num_embeddings})")
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.sequence_dim = sequence_dim
        self.vocab_start, self.vocab_real_end, self.vocab_end = vocab_range(num_embeddings, tp.rank, tp.size)
        self.weight_spec = ParamSpec(
            (num_embeddings, embedding_dim), partition_dim=0, padded=padded_vocab_size(num_embeddings, tp.size)
        )
        local = self.weight_spec.local_shape(tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(local, dtype=dtype, device=device))
        self.reset_parameters()

    @property
    def rows_per_rank(self) -> int:
        return self.vocab_end - self.vocab_start

    @property
    def local_padding_idx(self) -> int | None:
        if self.padding_idx is None or not self.vocab_start <= self.padding_idx < self.vocab_real_end:
            return None
        return self.padding_idx - self.vocab_start

    def reset_parameters(self) -> None:
        full = torch.empty(self.num_embeddings, self.embedding_dim, dtype=torch.float32)
        nn.init.normal_(full)
        if self.padding_idx is not None:
            full[self.padding_idx].zero_()
        self.load_dense(full)

    def load_dense(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of a dense ``[V, h]`` table in (padding rows set to zero)."""
        with torch.no_grad():
            self.weight.copy_(self.weight_spec.slice_global(weight.detach(), self.tp.rank, self.tp.size))

    def tensor_parallel_specs(self) -> dict[str, ParamSpec]:
        return {"weight": self.weight_spec}

    def _check_ids(self, tokens: torch.Tensor) -> None:
        # Every tensor rank sees the same ids, so this error is raised alike on all of them (no hang). An id in
        # [V, padded) would silently read a zero padding row on the last rank: refuse it instead.
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.num_embeddings):
            raise IndexError(
                f"VocabParallelEmbedding: token ids must lie in [0, {self.num_embeddings}), got "
                f"min {int(tokens.min())}, max {int(tokens.max())}"
            )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self._check_ids(tokens)
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight, self.padding_idx)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local_ids = (tokens - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight, self.local_padding_idx)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)  # zero rows: and no gradient reaches row 0
        if self.tp.sequence_parallel:
            return reduce_scatter_to_sequence_region(partial, self.tp, self.sequence_dim)  # ḡ
        return reduce_from_tensor_region(partial, self.tp)  # g

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp.size}, rows=[{self.vocab_start}, "
            f"{self.vocab_real_end}) + {self.vocab_end - self.vocab_real_end} padding"
        )


def tied_lm_logits(
    hidden: torch.Tensor, weight: torch.Tensor, tp: TensorParallel, sequence_dim: int = 1
) -> torch.Tensor:
    """``hidden @ weightᵀ`` on this rank's vocabulary rows → logits ``[..., c]`` split over the vocabulary (padding
    columns included: ``vocab_parallel_cross_entropy(vocab_size=V)`` excludes them; nothing is gathered).

    ``hidden`` enters the tensor-parallel region through ``f`` (its gradient is summed over the tensor axis), or,
    under sequence parallelism, is all-gathered along ``sequence_dim`` (``f̄``)."""
    if tp.sequence_parallel:
        hidden = gather_from_sequence_region(hidden, tp, sequence_dim)
    else:
        hidden = copy_to_tensor_region(hidden, tp)
    return F.linear(hidden, weight)


class VocabParallelLMHead(nn.Module):
    """An LM head tied to a ``VocabParallelEmbedding``: it holds the *same* parameter (registered here too, as
    Hugging Face ties ``lm_head.weight``), so the tied weight's gradient accumulates from both uses, and ZeRO-3
    gathers it for the head's own forward. Declares no spec of its own: the embedding's covers the parameter."""

    def __init__(self, embedding: VocabParallelEmbedding) -> None:
        super().__init__()
        self.tp = embedding.tp
        self.sequence_dim = embedding.sequence_dim
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return tied_lm_logits(hidden, self.weight, self.tp, self.sequence_dim)
