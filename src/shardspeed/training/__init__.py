"""The engine's training loop, apart from its construction (see [Note: engine layout] in ``engine.py``).

- ``step_core.py``: one optimizer step at an accumulation boundary: norm → overflow → unscale×clip → step, every
  decision identical on all ranks.
- ``micro_driver.py``: the user-driven loop (``engine.backward(loss)`` / ``engine.step()``): loss scaling by 1/GAS,
  the reducer protocol, accumulation boundaries, ``no_sync()``, the counters.
- ``events.py``: what the loop announces (phases, finished steps) to its listeners: timers, the progress log, and
  later monitors, the profiler and the autotuner.
"""

from shardspeed.training.events import EngineEvents, EngineListener, StepReport
from shardspeed.training.micro_driver import MicroStepDriver, Progress
from shardspeed.training.step_core import StepCore, StepOutcome

__all__ = [
    "EngineEvents",
    "EngineListener",
    "MicroStepDriver",
    "Progress",
    "StepCore",
    "StepOutcome",
    "StepReport",
]
