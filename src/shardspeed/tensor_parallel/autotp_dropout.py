"""Dropout inside the sequence-parallel blocks of an AutoTP model: a per-tensor-rank stream for each block call.

[Note: AutoTP block dropout streams] Under sequence parallelism everything a Hugging Face block drops out holds
different numbers on each tensor rank: the residual dropouts act on this rank's sequence shard, the attention
dropout on this rank's heads ([Note: AutoTP sequence parallelism] in autotp_sequence.py). So every draw inside a
block must differ per tensor rank, or each rank's different tokens lose the same pattern. Megatron (and
``TensorParallelDropout``) forks the RNG tracker's model-parallel stream; for a block AutoTP does not own that is
not safe: HF's gradient checkpointing (``model.gradient_checkpointing_enable()``) recomputes a block through
``torch.utils.checkpoint``, which replays the default generators only, so a tracker fork in the recompute would
start from the stream's *advanced* state and draw other masks than the forward did — silently wrong gradients.

So the per-rank stream is derived from the default one. On entering a block (training only) one seed is drawn from
the CPU default generator — the same number on every rank, since the default stream is seeded alike — and the
block's device generator runs on ``seed + tensor rank`` for the block's call, then gets its own state back. A
recompute replays the CPU state from before the draw, so it draws the same seed and the same masks; a resume
restores the default stream (``checkpoint/rng.py``), so nothing else needs saving. Dropout inside SDPA (GPT-2's and
LLaMA's attention pass ``dropout_p`` to it, bypassing any ``nn.Dropout`` module) draws from the same device
generator, so it is covered too — replacing ``nn.Dropout`` modules would miss it. The default stream advances by
one draw per block call; the hooks are installed only when the blocks have dropout (``blocks_have_dropout``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardspeed.checkpointing.rng import get_rng_state, manual_seed, set_rng_state
from shardspeed.tensor_parallel.context import TensorParallel

DROPOUT_CONFIG_KEYS: tuple[str, ...] = ("attention_dropout", "attn_pdrop", "resid_pdrop", "hidden_dropout")
"""Config fields of HF models that hold a dropout probability used inside the blocks without an ``nn.Dropout``."""

_SEED_BOUND = 2**62  # a seed plus a tensor rank stays a valid (non-negative, 64-bit) seed


def blocks_have_dropout(model: nn.Module, blocks: nn.Module) -> bool:
    """Whether anything inside ``blocks`` may drop out: an ``nn.Dropout`` with p > 0, or a dropout probability in
    the model's config (LLaMA's ``attention_dropout`` is a float handed to the attention function)."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in blocks.modules()):
        return True
    config = getattr(model, "config", None)
    return any(float(getattr(config, key, 0.0) or 0.0) > 0 for key in DROPOUT_CONFIG_KEYS)


def _first_tensor(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def install_block_streams(blocks: nn.ModuleList, tp: TensorParallel) -> list[Any]:
    """Run every block's call on its per-tensor-rank stream ([Note: AutoTP block dropout streams]); returns the
    hook handles."""
    handles: list[Any] = []
    for block in blocks:
        saved: list[tuple[torch.device, torch.Tensor] | None] = []  # one entry per call in flight (a recompute nests)

        def enter(module: nn.Module, args: tuple, kwargs: dict, saved: list = saved) -> None:
            x = _first_tensor(args, kwargs)
            if not module.training or x is None:
                saved.append(None)
                return
            seed = int(torch.randint(0, _SEED_BOUND, (1,)).item())  # the CPU default stream: alike on every rank
            device = x.device if x.device.type == "cuda" else torch.device("cpu")
            saved.append((device, get_rng_state(device)))
            manual_seed(device, seed + tp.rank)

        def leave(module: nn.Module, args: tuple, kwargs: dict, output: Any, saved: list = saved) -> None:
            entry = saved.pop() if saved else None
            if entry is not None:
                set_rng_state(*entry)

        handles.append(block.register_forward_pre_hook(enter, with_kwargs=True))
        # always_call: a block that raises (or a recompute torch ends early by raising) still gets its state back
        handles.append(block.register_forward_hook(leave, with_kwargs=True, always_call=True))
    return handles
