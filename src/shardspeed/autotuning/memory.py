"""Predicted memory of a tuning point, the budgets, pruning, and the fitted correction (pure: no processes).

[Note: the prediction] Per rank, for a point (stage, offload, micro-batch, activation checkpointing):
  model states = ``zero/memory.py``'s exact bytes for that stage and offload (the engine's own accounting, padded
  flat buffers aside), split into the device part and the host (offloaded) part;
  activations = the saved-tensor bytes of ONE profiled micro-batch (activation.py; the checkpointed figure when
  the point checkpoints) × the micro-batch size;
  device = device states + scale × activations (+ offset on CUDA, where the fit is against device memory);
  host = offloaded states (+ the runtime's baseline) per rank × ranks per node.
On a CPU-only machine the "device" is simulated (``--device_memory_gb``): the budget a GPU of that size would
impose; everything really lives in the process's RSS, so what a trial measures is the peak RSS and the fit is
``peak RSS = offset + all model states + scale × activations`` (offset: the interpreter, torch, buffers).

[Note: the correction] Before any trial the correction comes from the profile runs themselves (scales and
offset from two micro-batch sizes: profile_run.py's [Note: two-point profile]). After each trial that ran,
``fit_correction`` refits them by least squares over (predicted parts, measured peak) of every "ok" trial: one
offset, one activation scale for plain points and one for checkpointed points (a scale moves only once its kind
of point ran ``MIN_FIT_TRIALS`` times, at two activation sizes or more). Predictions recorded per trial are those
made *before* it ran; the summary also gives the final fit's error for every trial.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shardspeed.autotuning.space import Point
from shardspeed.zero.memory import ModelStateBytes, model_state_bytes

__all__ = [
    "Budgets",
    "Correction",
    "ModelProfile",
    "Prediction",
    "fit_correction",
    "predict",
    "prune",
]


@dataclass(frozen=True)
class ModelProfile:
    """What the profile run measured (the engine's ``model_info`` JSON, autotuning/probe.py)."""

    num_params: int
    activation_bytes_per_sample: float
    """Saved-tensor bytes of one sample, without activation checkpointing."""
    checkpointed_bytes_per_sample: float | None = None
    """The same with the script's activation checkpointing on (None: not profiled)."""
    baseline_bytes: int = 0
    """The profile run's peak memory less its model states and activations: the runtime's own (see Correction)."""


@dataclass(frozen=True)
class Budgets:
    device_bytes: int | None
    """Per rank; None: no device budget (nothing pruned for it)."""
    host_bytes: int | None
    """Per node; None: no host budget."""
    ranks_per_node: int = 1
    on_cpu: bool = True
    """The device is simulated ([Note: the prediction]): the fit is against peak RSS."""


@dataclass(frozen=True)
class Correction:
    """measured ≈ offset + states + scale × activations ([Note: the correction])."""

    scale: float = 1.0
    offset: float = 0.0
    trials: int = 0
    """How many measured trials the fit used (0: the profile runs' figures only)."""
    checkpointed_scale: float | None = None
    """The scale of points with activation checkpointing (None: ``scale``). Their saved tensors are only the
    blocks' inputs, while the step's peak also holds one block's recomputed activations: per counted byte that is
    several times the plain points' scale, so one scale for both fits neither."""

    def scale_for(self, point: Point) -> float:
        if point.checkpoint_activations and self.checkpointed_scale is not None:
            return self.checkpointed_scale
        return self.scale


@dataclass(frozen=True)
class Prediction:
    states: ModelStateBytes
    activation_bytes: float
    """Raw (uncorrected) activation bytes of one micro-batch."""
    device_bytes: float
    host_bytes_per_rank: float
    measured_equivalent: float
    """What a trial should measure (peak RSS on CPU, CUDA max allocated on a GPU), with the correction."""

    def as_dict(self) -> dict[str, float]:
        return {
            "states_device_bytes": self.states.total(),
            "states_host_bytes": self.states.cpu,
            "activation_bytes": self.activation_bytes,
            "device_bytes": self.device_bytes,
            "host_bytes_per_rank": self.host_bytes_per_rank,
            "predicted_measured_bytes": self.measured_equivalent,
        }


def activation_bytes(point: Point, profile: ModelProfile) -> float:
    per_sample = profile.activation_bytes_per_sample
    if point.checkpoint_activations and profile.checkpointed_bytes_per_sample is not None:
        per_sample = profile.checkpointed_bytes_per_sample
    return per_sample * point.micro_batch


def states_for(
    point: Point, profile: ModelProfile, dp_world: int, precision: str, optimizer_state_bytes: int | None
) -> ModelStateBytes:
    return model_state_bytes(
        profile.num_params,
        dp_world,
        point.stage,
        precision=precision,
        accounting="shardspeed",
        optimizer_state_bytes_per_param=optimizer_state_bytes,
        offload_optimizer=point.offload_optimizer != "none",
        offload_param=point.offload_param != "none",
    )


def predict(
    point: Point,
    profile: ModelProfile,
    dp_world: int,
    correction: Correction,
    *,
    on_cpu: bool = True,
    precision: str = "fp32",
    optimizer_state_bytes: int | None = None,
) -> Prediction:
    """[Note: the prediction]."""
    states = states_for(point, profile, dp_world, precision, optimizer_state_bytes)
    act = activation_bytes(point, profile)
    corrected = correction.scale_for(point) * act
    if on_cpu:
        device = states.total() + corrected
        host = states.cpu + correction.offset
        measured = correction.offset + states.total() + states.cpu + corrected
    else:
        device = states.total() + corrected + correction.offset
        host = states.cpu + profile.baseline_bytes
        measured = device
    return Prediction(states, act, device, host, measured)


def prune(
    points: Sequence[Point], predictions: Sequence[Prediction], budgets: Budgets
) -> tuple[list[int], list[tuple[int, str]]]:
    """Indices of the points that fit both budgets, and (index, why) for every one that cannot."""
    kept: list[int] = []
    pruned: list[tuple[int, str]] = []
    for index, prediction in enumerate(predictions):
        why = []
        if budgets.device_bytes is not None and prediction.device_bytes > budgets.device_bytes:
            why.append(f"device {prediction.device_bytes / 1e9:.3f} GB > budget {budgets.device_bytes / 1e9:.3f} GB")
        host = prediction.host_bytes_per_rank * budgets.ranks_per_node
        if budgets.host_bytes is not None and host > budgets.host_bytes:
            why.append(f"host {host / 1e9:.3f} GB > budget {budgets.host_bytes / 1e9:.3f} GB")
        if why:
            pruned.append((index, "; ".join(why)))
        else:
            kept.append(index)
    assert len(kept) + len(pruned) == len(points)
    return kept, pruned


MIN_FIT_TRIALS = 3
"""Trials of one kind (plain / checkpointed) before its scale is refitted. Two trials that differ in stage and
offload as well as in micro-batch give a slope that is mostly the difference of their runtime buffers (the demo's
tune: a ZeRO-3 + offload point at micro-batch 64 and a ZeRO-0 point at 32 made the checkpointed scale 13 and the next
prediction 39% low); the profiles' scale holds until a third."""


def fit_correction(samples: Sequence[tuple[float, float, float, bool]], prior: Correction) -> Correction:
    """Least squares ``measured - states = offset + scale × plain activations + checkpointed_scale × checkpointed
    activations`` over (states, activations, measured, checkpointed) of the trials that ran ([Note: the
    correction]). A scale is fitted only where its kind of point ran ``MIN_FIT_TRIALS`` times at two activation
    sizes or more (else the prior's is kept and only the offset moves), and a non-positive one (noise on a flat
    term) falls back to the prior's."""
    if not samples:
        return prior
    states = np.array([s[0] for s in samples], dtype=float)
    acts = np.array([s[1] for s in samples], dtype=float)
    residual = np.array([s[2] for s in samples], dtype=float) - states
    checkpointed = np.array([bool(s[3]) for s in samples])
    priors = {
        False: prior.scale,
        True: prior.checkpointed_scale if prior.checkpointed_scale is not None else prior.scale,
    }
    free: list[bool] = []
    for kind in (False, True):
        column = acts[checkpointed == kind]
        if len(column) >= MIN_FIT_TRIALS and len(set(column.tolist())) >= 2:
            free.append(kind)
        else:
            residual = residual - np.where(checkpointed == kind, priors[kind] * acts, 0.0)
    scales = dict(priors)
    if free:
        design = np.stack([np.ones_like(acts)] + [np.where(checkpointed == k, acts, 0.0) for k in free], axis=1)
        solution, *_ = np.linalg.lstsq(design, residual, rcond=None)
        if all(value > 0 for value in solution[1:]):
            scales.update({k: float(v) for k, v in zip(free, solution[1:])})
            return _correction(scales, float(solution[0]), len(samples), prior)
        for k in free:  # refit the offset alone with the prior scales
            residual = residual - np.where(checkpointed == k, priors[k] * acts, 0.0)
    return _correction(scales, float(np.mean(residual)), len(samples), prior)


def _correction(scales: dict[bool, float], offset: float, trials: int, prior: Correction) -> Correction:
    checkpointed = scales[True] if (prior.checkpointed_scale is not None or scales[True] != scales[False]) else None
    return Correction(scales[False], offset, trials, checkpointed)
