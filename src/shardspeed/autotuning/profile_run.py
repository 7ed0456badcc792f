"""Step 1 of a tune (tune.py): the profile runs that measure the model before any trial.

One process, ZeRO 0, the engine's ``model_info.profile`` (probe.py): the parameter count, the saved-tensor bytes
of one micro-batch and the peak memory over the profile's few steps (``PROFILE_STEPS``).

[Note: two-point profile] Saved tensors are not all of a step's activation memory (backward's transient gradients
of activations, non-saved intermediates: activation.py's [Note: what the count misses]), so the memory a trial
measures grows by ``scale × saved bytes`` per sample with ``scale`` > 1 (about 1.5 for the demo GPT on CPU). One
profile at micro-batch 1 cannot tell that scale from the runtime's offset, and a tune that starts at scale 1
under-predicts its largest micro-batches by a third of their activations until enough trials have run to refit.
A second profile at a larger micro-batch ``k`` fixes both before anything is pruned:
``scale = (peak_k - peak_1) / (saved_k - saved_1)``, ``offset = peak_1 - states - scale × saved_1``. ``k`` is
the largest power of two ≤ ``max_train_micro_batch_size_per_gpu`` (and ≤ 32, to keep the profile short) whose
activations use at most half of what the device budget leaves beside the model states, so the profile itself
fits on a real device; a second run that fails, or a slope outside ``SCALE_RANGE`` (noise on a tiny activation term),
keeps scale 1 and says so. With activation checkpointing mapped, the checkpointed points get their own scale the
same way (profiles at 1 and the same ``k``): per counted byte they hold far more (memory.py, ``Correction``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardspeed.autotuning.args import script_args_for
from shardspeed.autotuning.memory import Budgets, Correction, ModelProfile, states_for
from shardspeed.autotuning.runner import Experiment, ExperimentResult
from shardspeed.autotuning.space import AC_ARG, Point, materialize
from shardspeed.config.autotuning import AutotuningConfig

__all__ = ["ProfileError", "profile_model", "second_micro_batch", "two_point_correction"]

Runner = Callable[[Experiment], ExperimentResult]
MAX_PROFILE_MICRO_BATCH = 32
SCALE_RANGE = (0.25, 64.0)  # checkpointed points: ~7-13 on the demo (their counted bytes are only block inputs)


class ProfileError(RuntimeError):
    """The first profile run failed: nothing can be predicted."""


def second_micro_batch(per_sample: float, states: float, device_budget: int | None, max_micro_batch: int) -> int:
    """``k`` of [Note: two-point profile] (pure); 1 means no second profile."""
    room = math.inf if device_budget is None else (device_budget - states) / 2
    k = 1
    while 2 * k <= min(max_micro_batch, MAX_PROFILE_MICRO_BATCH) and 2 * k * per_sample <= room:
        k *= 2
    return k


def two_point_correction(first: dict[str, Any], second: dict[str, Any] | None, states: float) -> tuple[Correction, str]:
    """Scale and offset from the two profiles' (saved bytes, peak) (pure); with a note for the summary."""
    peak1 = _peak(first)
    if second is not None:
        rise, saved = _peak(second) - peak1, second["activation_bytes"] - first["activation_bytes"]
        scale = rise / saved if saved > 0 else math.nan
        if SCALE_RANGE[0] < scale < SCALE_RANGE[1]:
            sizes = f"{first['micro_batch']} and {second['micro_batch']}"
            note = f"activation scale {scale:.3f} from profiles at micro-batch {sizes}"
            return Correction(scale, peak1 - states - scale * first["activation_bytes"], 0), note
        why = f"the two profiles' slope {scale:.3g} is outside {SCALE_RANGE}"
    else:
        why = "one profile only"
    return Correction(1.0, peak1 - states - first["activation_bytes"], 0), f"activation scale 1 ({why})"


def _peak(info: dict[str, Any]) -> float:
    return float(info.get("device_peak_bytes") or info["host_peak_bytes"])


def profile_model(
    *,
    script: str,
    script_args: list[str],
    launcher_args: list[str],
    user: dict[str, Any],
    tuning: AutotuningConfig,
    exps: Path,
    run: Runner,
    budgets: Budgets,
    precision: str,
    opt_bytes: int | None,
) -> tuple[ModelProfile, Correction, str]:
    """The module docstring's runs: the profile, the prior correction, and the correction's note."""

    def measure(point: Point, name: str, required: bool) -> dict[str, Any] | None:
        config = materialize(user, point, 1)
        section = dict(config.get("autotuning") or {})
        info_path = exps / name / "model_info.json"
        section.update(model_info={"profile": True}, model_info_path=str(info_path))
        config["autotuning"] = section
        args = script_args_for(script_args, config, point, tuning.arg_mappings)
        experiment = Experiment(
            name, script, args, config, 1, info_path.parent, tuning.trial_timeout_s, launcher_args=launcher_args
        )
        result = run(experiment)
        try:
            return json.loads(info_path.read_text())
        except (OSError, ValueError):
            message = f"the profile run ({info_path.parent}) failed: {result.status}: {result.error}"
            if required:
                raise ProfileError(f"{message}; see {result.log_path}") from None
            print(f"[autotuning] {message}: the activation scale stays 1", file=sys.stderr, flush=True)
            return None

    plain = measure(Point(0, 1, 1, checkpoint_activations=False), "profile", True)
    assert plain is not None
    ac = None
    if (tuning.arg_mappings or {}).get(AC_ARG):
        ac = measure(Point(0, 1, 1, checkpoint_activations=True), "profile_ac", True)
    num_params = int((tuning.model_info or {}).get("num_params") or plain["trainable_num_params"])
    per_sample = plain["activation_bytes"] / plain["micro_batch"]
    checkpointed = ac["activation_bytes"] / ac["micro_batch"] if ac is not None else None
    profile = ModelProfile(num_params, per_sample, checkpointed, 0)
    held = states_for(Point(0, 1, 1), profile, 1, precision, opt_bytes)  # what the profile's process holds
    states = held.total() + (held.cpu if budgets.on_cpu else 0)
    k = second_micro_batch(per_sample, states, budgets.device_bytes, tuning.max_train_micro_batch_size_per_gpu)
    second = measure(Point(0, k, 1, checkpoint_activations=False), f"profile_mb{k}", False) if k > 1 else None
    correction, note = two_point_correction(plain, second, states)
    if ac is not None:  # the checkpointed points' own scale, the same way ([Note: two-point profile])
        assert checkpointed is not None
        # the plain points' k: checkpointing only lowers a micro-batch's memory, so it fits where they did
        second_ac = measure(Point(0, k, 1, checkpoint_activations=True), f"profile_ac_mb{k}", False) if k > 1 else None
        checkpointed_fit, ac_note = two_point_correction(ac, second_ac, states)
        correction = dataclasses.replace(correction, checkpointed_scale=checkpointed_fit.scale)
        note += f"; checkpointed: {ac_note}"
    return ModelProfile(num_params, per_sample, checkpointed, int(max(correction.offset, 0))), correction, note
