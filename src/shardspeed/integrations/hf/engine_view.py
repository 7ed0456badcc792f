"""What the HF Trainer holds after wrapping: the engine seen as a model, an optimizer and an LR scheduler.

The Trainer's loop talks to three objects — ``model_wrapped`` (forward, ``train()``/``eval()``, ``zero_grad()``,
``parameters()``), ``self.optimizer`` (``step()``, ``zero_grad()``, ``param_groups``) and ``self.lr_scheduler``
(``step()``, ``get_last_lr()``). With shardspeed the engine owns all three jobs: ``engine.backward`` + ``engine.step``
run in ``ShardSpeedTrainer.training_step`` (the optimizer step, clipping and the LR schedule happen inside
``engine.step()`` at the accumulation boundary, exactly as accelerate's ``DeepSpeedEngineWrapper.backward`` does for
DeepSpeed), so the optimizer and scheduler the Trainer steps are views whose ``step()`` does nothing — accelerate's
``DeepSpeedOptimizerWrapper`` / ``DeepSpeedSchedulerWrapper`` do the same. They are deliberately *not*
``torch.optim.Optimizer`` / ``LRScheduler`` subclasses: ``accelerator.prepare`` then returns them unchanged instead
of wrapping them for plain data-parallel training.
"""

from __future__ import annotations

from typing import Any

import torch


class EngineModule(torch.nn.Module):
    """The engine as the Trainer's ``model_wrapped``. ``module`` is the user's model (registered as a child, so
    ``parameters()``, ``train()`` and ``eval()`` reach it); calls go through ``engine.forward``."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.module = engine.module
        # Not an attribute nn.Module would register: the engine is not a Module (and must not be moved, cast or
        # traversed by module utilities).
        object.__setattr__(self, "engine", engine)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.forward(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # nn.Module.zero_grad would set param.grad = None, cutting the engine's gradient views (stages 0-1 keep
        # .grad as views of the flat buffer); the engine zeroes its own buffers.
        self.engine.zero_grad()

    def get_global_grad_norm(self) -> float | None:
        return self.engine.get_global_grad_norm()


class EngineOptimizer:
    """The Trainer's ``self.optimizer``: ``param_groups`` are the engine optimizer's (so the learning rate the
    Trainer reads is the one in use); ``step()``/``zero_grad()`` do nothing (``engine.step()`` already ran)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.engine.optimizer.state

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError(
            "the optimizer state lives in the shardspeed engine (sharded): save it with the engine's "
            "save_checkpoint (ShardSpeedTrainer does, in each checkpoint directory)"
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError("optimizer state is restored by the shardspeed engine's load_checkpoint")


class EngineScheduler:
    """The Trainer's ``self.lr_scheduler``: ``step()`` does nothing (the engine steps its scheduler at the
    boundary); ``get_last_lr()`` is the learning rate of the last optimizer step, which is what the plain Trainer
    logs (it reads the rate after ``optimizer.step()`` and before ``lr_scheduler.step()``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.last_step_lr: list[float] | None = None

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return list(self.last_step_lr) if self.last_step_lr is not None else self.engine.get_lr()

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("the LR scheduler's state is saved by the shardspeed engine's save_checkpoint")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError("the LR scheduler's state is restored by the shardspeed engine's load_checkpoint")
