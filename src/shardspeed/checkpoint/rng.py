"""RNG states as plain JSON (base64 for torch's byte states), so checkpoints never need pickle.

Besides the global generators (torch, python, numpy, cuda) a checkpoint holds the model-parallel RNG trackers'
named states — the streams dropout in tensor-parallel (split) regions draws from ([Note: tensor-parallel dropout
streams] in tensor_parallel/random.py) — or a resumed run would draw other masks there than the uninterrupted one:
``"trackers": {"default": states | None, "model": [states, ...]}``, ``default`` being
``shardspeed.checkpointing``'s default context's tracker (if one existed) and ``model`` the distinct trackers the
model's layers hold (``model_rng_trackers``), in module order. Like the rest, saved per global rank. Checkpoints
from before the key existed load with the trackers left as they are.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

from shardspeed.checkpointing.api import existing_rng_tracker, get_rng_tracker
from shardspeed.checkpointing.rng import RNGStatesTracker
from shardspeed.log import logger


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def _tracker_states(tracker: RNGStatesTracker) -> dict[str, str]:
    return {name: _b64(state) for name, state in tracker.get_states().items()}


def _set_tracker_states(tracker: RNGStatesTracker, states: dict[str, str]) -> None:
    tracker.set_states({name: _unb64(text) for name, text in states.items()})


def capture_rng(model_trackers: list[RNGStatesTracker] | None = None) -> dict[str, Any]:
    """This rank's generator states; with ``model_trackers`` (the model's, ``model_rng_trackers``) also the
    trackers' states: the default context's and those."""
    version, state, gauss = random.getstate()
    np_state = np.random.get_state()
    out: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "python": [version, list(state), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    if torch.cuda.is_available():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    if model_trackers is not None:
        default = existing_rng_tracker()
        out["trackers"] = {
            "default": _tracker_states(default) if default is not None else None,
            "model": [_tracker_states(t) for t in model_trackers],
        }
    return out


def restore_trackers(saved: dict[str, Any], model_trackers: list[RNGStatesTracker]) -> None:
    """Put the saved tracker states back. The default context's is made if the loading process has none yet (a
    layer may look it up lazily); the model's go back in module order, and only if their number matches (another
    model structure: its streams are left alone, with a warning, rather than handed states meant elsewhere)."""
    if saved.get("default") is not None:
        _set_tracker_states(get_rng_tracker(), saved["default"])
    model = saved.get("model") or []
    if len(model) != len(model_trackers):
        if model:
            logger.warning(
                f"checkpoint holds {len(model)} model RNG tracker(s) but the model has {len(model_trackers)}: "
                "their model-parallel streams are not restored (dropout in split regions draws new masks)"
            )
        return
    for tracker, states in zip(model_trackers, model, strict=True):
        _set_tracker_states(tracker, states)


def restore_rng(state: dict[str, Any], model_trackers: list[RNGStatesTracker] | None = None) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    version, values, gauss = state["python"]
    random.setstate((version, tuple(values), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        states = [_unb64(s) for s in state["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    if model_trackers is not None and state.get("trackers") is not None:
        restore_trackers(state["trackers"], model_trackers)
