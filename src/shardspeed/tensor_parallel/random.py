"""Dropout in tensor-parallel models: which random stream each dropout draws from.

[Note: tensor-parallel dropout streams] Two kinds of activations, two streams (Megatron's and DeepSpeed's
``get_cuda_rng_tracker().fork()``):
- *replicated* activations (the residual stream, the embedding output without sequence parallelism) hold the same
  numbers on every tensor rank and must keep doing so: their dropout draws from the default generator, seeded
  alike on every rank;
- *split* activations (attention probabilities of this rank's heads, the MLP's column-parallel slice, anything on
  a sequence shard under sequence parallelism) hold different elements per rank: their dropout draws from the
  tracker's model-parallel stream, seeded ``seed + 2718 + tensor rank``, so the ranks' masks are independent (one
  stream for all would drop the same pattern in every slice).
The tracker is ``shardspeed.checkpointing``'s ``RNGStatesTracker``, passed down explicitly (the model holds the
one it was built with; no module-level lookup). Use the *same* tracker as the activation-checkpointing context
(``CheckpointingContext(tracker=...)``, or the default context's ``get_cuda_rng_tracker()``): a checkpointed
region snapshots that context's tracker, so its recompute replays exactly the forward's masks.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from shardspeed.checkpointing.rng import MODEL_PARALLEL_RNG, MODEL_PARALLEL_SEED_OFFSET, RNGStatesTracker, manual_seed
from shardspeed.tensor_parallel.context import TensorParallel

Region = Literal["split", "replicated"]


def model_parallel_seed(tracker: RNGStatesTracker, tp: TensorParallel, seed: int) -> None:
    """Seed the default generator of ``tracker``'s device with ``seed`` (alike on every rank) and the tracker's
    model-parallel stream with ``seed + 2718 + tp.rank`` — DeepSpeed's ``model_parallel_cuda_manual_seed`` with
    the tensor rank taken from ``tp`` (the topology passed down), not from a global."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"model_parallel_seed(seed={seed!r}): expected a non-negative integer")
    manual_seed(tracker.device, seed)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tp.rank)


def tensor_parallel_dropout(
    x: torch.Tensor, p: float, training: bool, tracker: RNGStatesTracker | None, region: Region
) -> torch.Tensor:
    """``F.dropout(x, p, training)`` drawing from the stream ``region`` calls for ([Note: tensor-parallel dropout
    streams]): ``"split"`` forks into the tracker's model-parallel stream, ``"replicated"`` uses the default."""
    if not training or p == 0.0:
        return x
    if region == "replicated":
        return F.dropout(x, p, training=True)
    if region != "split":
        raise ValueError(f"tensor_parallel_dropout: region must be 'split' or 'replicated', got {region!r}")
    if tracker is None:
        raise ValueError(
            "dropout on tensor-parallel (split) activations needs the model-parallel RNG tracker: pass one "
            "(seeded with model_parallel_seed) to the model"
        )
    with tracker.fork(MODEL_PARALLEL_RNG):
        return F.dropout(x, p, training=True)


class TensorParallelDropout(nn.Module):
    """``nn.Dropout`` for a tensor-parallel model: ``region="split"`` (activations that differ per tensor rank)
    draws from ``tracker``'s model-parallel stream, ``"replicated"`` from the default generator."""

    def __init__(self, p: float, tracker: RNGStatesTracker | None, region: Region) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must lie in [0, 1], got {p}")
        if region not in ("split", "replicated"):
            raise ValueError(f"TensorParallelDropout: region must be 'split' or 'replicated', got {region!r}")
        self.p = p
        self.tracker = tracker
        self.region: Region = region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tensor_parallel_dropout(x, self.p, self.training, self.tracker, self.region)

    def extra_repr(self) -> str:
        return f"p={self.p}, region={self.region}"
