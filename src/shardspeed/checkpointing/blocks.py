"""Model-level helpers: checkpoint every k-th block of a stack of blocks.

"Every k-th" is literal: blocks 0, k, 2k, … run as checkpointed regions (only their inputs are kept), the others
run normally. ``every=1`` checkpoints every block — the usual choice, with activation memory
``L·b_in + b_block`` instead of ``L·b_block`` — and larger ``every`` recomputes fewer blocks in exchange for
keeping more activations. (To recompute *all* blocks while keeping only every k-th input, group the blocks
into ``nn.Sequential`` segments of k and checkpoint each segment with ``every=1``.)

Each checkpointed block is called through ``block(...)`` — ``nn.Module.__call__`` — so its hooks run again in the
recompute; ZeRO-3's parameter-gathering hooks rely on that.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from torch import nn

from .api import default_context
from .context import CheckpointingContext


def _checked_every(every: int) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every={every!r}: expected a positive integer (1 checkpoints every block)")
    return every


def run_blocks(
    blocks: Sequence[nn.Module],
    hidden: Any,
    *extra_args: Any,
    every: int = 1,
    context: CheckpointingContext | None = None,
    **extra_kwargs: Any,
) -> Any:
    """Thread ``hidden`` through ``blocks`` (``hidden = block(hidden, *extra_args, **extra_kwargs)``), running
    blocks 0, every, 2·every, … as checkpointed regions of ``context`` (default: the module-level one, looked up
    now so a later ``configure()`` applies). For an ``nn.ModuleList`` inside a model's ``forward``."""
    every = _checked_every(every)
    ctx = context if context is not None else default_context()
    for index, block in enumerate(blocks):
        if index % every == 0:
            hidden = ctx.checkpoint(block, hidden, *extra_args, **extra_kwargs)
        else:
            hidden = block(hidden, *extra_args, **extra_kwargs)
    return hidden


class CheckpointedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose forward checkpoints every ``every``-th child (see ``run_blocks``)."""

    def __init__(
        self,
        *modules: nn.Module | OrderedDict[str, nn.Module],
        every: int = 1,
        context: CheckpointingContext | None = None,
    ) -> None:
        super().__init__(*modules)
        self.every = _checked_every(every)
        self.context = context

    def forward(self, hidden: Any) -> Any:
        return run_blocks(list(self), hidden, every=self.every, context=self.context)


def checkpoint_sequential(
    model: nn.Sequential, every: int = 1, context: CheckpointingContext | None = None
) -> CheckpointedSequential:
    """A ``CheckpointedSequential`` over ``model``'s children (shared, not copied; same child names, so the
    state_dict keys do not change). ``model`` itself is left as it was."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"checkpoint_sequential(model=...): expected an nn.Sequential, got {type(model).__name__}")
    return CheckpointedSequential(OrderedDict(model.named_children()), every=every, context=context)
