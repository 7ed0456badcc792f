"""An engine without an optimizer: ``initialize(model=..., config=...)`` with no ``optimizer`` section and no
client optimizer builds an evaluation/inference engine, as DeepSpeed does (Hugging Face's evaluation-only ZeRO-3
path relies on it). Forward works at every stage (ZeRO-3 gathers units as usual), checkpoints save and load the
module's weights; ``backward`` and ``step`` have nothing to drive and say so.
"""

from __future__ import annotations

from typing import Any


class NoOptimizerError(RuntimeError):
    """A training call on an engine built without an optimizer."""


def require_optimizer(optimizer: Any, what: str) -> Any:
    """``optimizer``, or a clear error naming ``what`` needed it when there is none."""
    if optimizer is None:
        call = "an LR scheduler" if what == "lr_scheduler" else f"engine.{what}()"
        raise NoOptimizerError(
            f"{call} needs an optimizer, but none was given to initialize(): this engine was built for "
            'evaluation only. Add an "optimizer" section to the config or pass optimizer= to initialize() to train.'
        )
    return optimizer
