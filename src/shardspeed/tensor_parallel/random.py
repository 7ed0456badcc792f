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
The tracker is ``shardspeed.checkpointing``'s ``RNGStatesTracker``, passed down explicitly (the layer holds the one
it was built with, or its ``TensorParallel`` carries one); a layer given none looks up the default context's at each
call (DeepSpeed's ``get_cuda_rng_tracker()``). Checkpoints save every such tracker's states (``model_rng_trackers``,
``checkpoint/rng.py``), so a resume draws the masks the uninterrupted run would. Use the *same* tracker as the
activation-checkpointing context (``CheckpointingContext(tracker=...)``, or the default context's
``get_cuda_rng_tracker()``): a checkpointed region snapshots that context's tracker, so its recompute replays
exactly the forward's masks.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from shardspeed.checkpointing.api import get_rng_tracker
from shardspeed.checkpointing.rng import MODEL_PARALLEL_RNG, RNGStatesTracker, seed_model_parallel
from shardspeed.tensor_parallel.context import TensorParallel, tensor_parallel_contexts

Region = Literal["split", "replicated"]
ModuleRegion = Literal["split", "replicated", "sequence"]
"""A ``TensorParallelDropout``'s region; ``"sequence"``: the residual stream, split iff ``tp.sequence_parallel``
(at TP > 1), replicated otherwise ([Note: sequence-parallel regions] in sequence.py)."""


def model_parallel_seed(tracker: RNGStatesTracker, tp: TensorParallel, seed: int) -> None:
    """Seed the default generator of ``tracker``'s device with ``seed`` (alike on every rank) and the tracker's
    model-parallel stream with ``seed + 2718 + tp.rank`` — DeepSpeed's ``model_parallel_cuda_manual_seed`` with
    the tensor rank taken from ``tp`` (the topology passed down), not from a global."""
    seed_model_parallel(tracker, seed, tp.rank)


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
    draws from the model-parallel stream of a tracker, ``"replicated"`` from the default generator, ``"sequence"``
    (the residual stream) is split iff ``tp.sequence_parallel`` at TP > 1 and needs ``tp``.

    The tracker: ``tracker`` if given, else ``tp.tracker`` if ``tp`` carries one, else ``shardspeed.checkpointing``'s
    default context's, looked up at each call (so a later ``model_parallel_manual_seed`` is seen).
    """

    def __init__(
        self, p: float, tracker: RNGStatesTracker | None, region: ModuleRegion, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must lie in [0, 1], got {p}")
        if region not in ("split", "replicated", "sequence"):
            raise ValueError(
                f"TensorParallelDropout: region must be 'split', 'replicated' or 'sequence', got {region!r}"
            )
        if region == "sequence" and tp is None:
            raise ValueError("TensorParallelDropout(region='sequence') needs tp= (whether sequence parallelism is on)")
        self.p = p
        self.tracker = tracker
        self.region: ModuleRegion = region
        self.tp = tp

    def _stream(self) -> Region:
        if self.region != "sequence":
            return self.region
        assert self.tp is not None  # checked at construction
        return "split" if self.tp.sequence_parallel and self.tp.size > 1 else "replicated"

    def stream_tracker(self) -> RNGStatesTracker:
        """The tracker split regions draw from (see the class docstring)."""
        if self.tracker is not None:
            return self.tracker
        if self.tp is not None and self.tp.tracker is not None:
            return self.tp.tracker
        return get_rng_tracker()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        region = self._stream()
        drawing = region == "split" and self.training and self.p > 0
        tracker = self.stream_tracker() if drawing else self.tracker
        return tensor_parallel_dropout(x, self.p, self.training, tracker, region)

    def extra_repr(self) -> str:
        return f"p={self.p}, region={self.region}"


def model_rng_trackers(module: nn.Module) -> list[RNGStatesTracker]:
    """Every distinct tracker ``module``'s layers were given explicitly — held by a ``TensorParallelDropout`` or
    carried by a ``TensorParallel`` — in module order: the model-parallel streams a checkpoint must save besides
    the default context's (``checkpoint/rng.py``)."""
    seen: dict[int, RNGStatesTracker] = {}
    for tp in tensor_parallel_contexts(module):
        if tp.tracker is not None:
            seen.setdefault(id(tp.tracker), tp.tracker)
    for sub in module.modules():
        tracker = getattr(sub, "tracker", None)
        if isinstance(sub, TensorParallelDropout) and tracker is not None:
            seen.setdefault(id(tracker), tracker)
    return list(seen.values())
