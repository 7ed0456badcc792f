"""Shared plumbing of DeepSpeed's per-batch LR schedulers: step counting, writing lrs, state.

Step-index convention (DeepSpeed's, kept so curves and checkpoints line up with DeepSpeed runs):
``last_batch_iteration`` is -1 at construction and becomes 0, 1, 2, ... with each ``step()``. The engine
calls ``step()`` *after* each optimizer step, so optimizer step ``k`` (0-based) runs with the lr of index
``k - 1``; the lr of index -1 is written into the optimizer when the scheduler is built. Every curve in this
package is a pure function of that index (``*_at(step, ...)``); the classes only apply it to param groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardspeed.config.errors import ConfigError


def per_group(value: float | Sequence[float], num_groups: int, name: str) -> list[float]:
    """One value per param group: a scalar is shared by all groups, a list must have one entry per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ConfigError(
                f"scheduler.params.{name} has {len(value)} values but the optimizer has {num_groups} "
                "param groups; give one number (shared) or one per group"
            )
        return [float(v) for v in value]
    return [float(value)] * num_groups


def group_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    """The current lr of every param group as floats (torch allows tensor lrs)."""
    return [float(group["lr"]) for group in optimizer.param_groups]


def write_lrs(optimizer: torch.optim.Optimizer, lrs: Sequence[float]) -> None:
    """Set each group's lr, in place for tensor lrs (keeps their device, dtype and identity, which
    capturable/fused optimizers and CUDA graphs rely on)."""
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


class BatchLRScheduler:
    """Base of the DeepSpeed schedules: subclasses give ``lrs_at(step)``, this class does the rest.

    Works with any object that has torch-style ``param_groups`` (a ZeRO wrapper included), since it only
    reads and writes ``group["lr"]`` (and ``group["betas"]`` in OneCycle).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(f"{type(self).__name__} needs an optimizer with param_groups, got {type(optimizer)}")
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int):
            raise TypeError(f"last_batch_iteration must be an int, got {last_batch_iteration!r}")
        if last_batch_iteration < -1:
            raise ValueError(f"last_batch_iteration must be >= -1, got {last_batch_iteration}")
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] = []

    def _start(self) -> None:
        """Subclasses call this at the end of ``__init__``: writes the lr of the current index, so the
        first optimizer step already runs on the schedule (DeepSpeed does this when starting at -1; we
        also do it when resuming at a later index, so the lr is right even before the first step())."""
        self._apply()

    def lrs_at(self, step: int) -> list[float]:
        """The lr of every param group at step index ``step``."""
        raise NotImplementedError

    def _apply_extras(self, step: int) -> None:
        """Hook for schedules that also drive something besides the lr (OneCycle's momentum)."""

    def _apply(self) -> None:
        lrs = self.lrs_at(self.last_batch_iteration)
        write_lrs(self.optimizer, lrs)
        self._apply_extras(self.last_batch_iteration)
        self._last_lr = lrs

    def get_lr(self) -> list[float]:
        """The lrs of the current step index (computed, not read back from the optimizer)."""
        return self.lrs_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The lrs last written into the optimizer."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to the next index (or jump to ``last_batch_iteration``) and write its lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = int(last_batch_iteration)
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """Only the step index: every lr is a pure function of it and the (config) parameters.

        Same shape as DeepSpeed's scheduler state, so checkpoints carry over. Subclasses add anything that
        came from the optimizer at construction (base lrs) and would otherwise be lost on resume.
        """
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the step index and re-write that step's lrs into the optimizer."""
        if "last_batch_iteration" not in state_dict:
            raise KeyError(f"{type(self).__name__} state_dict needs 'last_batch_iteration', got {list(state_dict)}")
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])
        self._apply()
