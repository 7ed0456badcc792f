"""Which point to try next: gridsearch, random, model_based (DeepSpeed's three tuner types), with DeepSpeed's
``tuner_early_stopping`` (stop after that many trials without a better metric) and ``tuner_num_trials`` (at most
that many trials). Pure: a tuner proposes points and is told results; ``tune.py`` runs them.

[Note: the model_based regressor] DeepSpeed fits XGBoost on its trials. Ours is ridge regression in numpy on a
handful of features (ZeRO stage, log2 micro-batch and its square, log2 GAS, offload flags, activation
checkpointing, log bucket sizes, overlap) predicting log(score): with a few dozen points and about ten noisy trials
a boosted-tree model has nothing to learn that this cannot, and numpy is already a dependency (no new package).
The stage is one ordinal feature, not a one-hot: three stage coefficients would need more trials than the budget to
be told apart from the noise of a short trial (±10% on CPU), while a higher stage costs throughput over the range a
tune sees (more communication); the micro-batch keeps its square (throughput saturates, or peaks, in it).
It starts from an initial design, then always runs the untried point with the best predicted score.

[Note: the initial design] The first trials must vary every dimension independently of the others, or the fit
confounds them: with the grid's first, last and middle points the largest micro-batch was seen only with
activation checkpointing on, the fit credited checkpointing with the micro-batch's gain, and the tuner kept to
checkpointed points (the demo on CPU: 78% of the grid's best). So the design is greedy D-optimal: over the
candidates' features, standardized, each next point is the one with the largest leverage ``xᵀ A⁻¹ x`` against
``A = λI + Σ x xᵀ`` of the points tried so far (the point that most increases ``det A``), until there are as many
trials as the features that vary plus one (the intercept) — at least ``INITIAL``. ``tuner_early_stopping``
counts the trials after the design (the design's are not the model's choices).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from shardspeed.autotuning.space import Point

__all__ = ["GridSearchTuner", "ModelBasedTuner", "RandomTuner", "Tuner", "build_tuner", "features", "score"]

INITIAL = 3
RIDGE = 1e-2


def score(metric: float | None, metric_name: str) -> float | None:
    """Larger is better: throughput and flops as they are, latency negated. None for a trial without a figure."""
    if metric is None:
        return None
    return -metric if metric_name == "latency" else metric


def features(point: Point) -> list[float]:
    """The model_based tuner's feature vector of a point ([Note: the model_based regressor])."""
    mb = math.log2(point.micro_batch)
    return [
        1.0,
        float(point.stage),
        mb,
        mb * mb,  # throughput saturates (or peaks) in the micro-batch
        math.log2(point.gas),
        float(point.offload_optimizer != "none"),
        float(point.offload_param != "none"),
        float(bool(point.checkpoint_activations)),
        math.log10(point.reduce_bucket_size) if point.reduce_bucket_size else 0.0,
        math.log10(point.allgather_bucket_size) if point.allgather_bucket_size else 0.0,
        float(point.overlap_comm is True),
    ]


@dataclass
class Tuner:
    """Grid order; subclasses change ``_propose``. ``next()`` → a point or None (done)."""

    points: Sequence[Point]
    metric_name: str = "throughput"
    early_stopping: int = 5
    num_trials: int = 50
    seed: int = 0
    tried: list[tuple[Point, float | None]] = field(default_factory=list)
    best: float | None = None
    since_best: int = 0
    stop_reason: str = ""

    def next(self) -> Point | None:
        if len(self.tried) >= min(self.num_trials, len(self.points)):
            self.stop_reason = self.stop_reason or (
                "tuner_num_trials reached" if len(self.tried) >= self.num_trials else "every point tried"
            )
            return None
        if self.best is not None and self.since_best >= self.early_stopping:
            self.stop_reason = f"tuner_early_stopping: {self.since_best} trials without a better metric"
            return None
        done = {p for p, _ in self.tried}
        return self._propose([p for p in self.points if p not in done])

    def record(self, point: Point, metric: float | None) -> None:
        value = score(metric, self.metric_name)
        self.tried.append((point, value))
        if value is not None and (self.best is None or value > self.best):
            self.best, self.since_best = value, 0
        else:
            self.since_best += 1

    def _propose(self, untried: list[Point]) -> Point:
        return untried[0]


class GridSearchTuner(Tuner):
    """Every point in grid order (stage, then micro-batch, ...), as DeepSpeed's gridsearch."""


@dataclass
class RandomTuner(Tuner):
    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def _propose(self, untried: list[Point]) -> Point:
        return self._rng.choice(untried)


@dataclass
class ModelBasedTuner(Tuner):
    """[Note: the model_based regressor]."""

    def __post_init__(self) -> None:
        self._design = _standardized([features(p) for p in self.points])
        self.design_size = max(INITIAL, self._design.shape[1] + 1)

    def record(self, point: Point, metric: float | None) -> None:
        super().record(point, metric)
        if len(self.tried) <= self.design_size:
            self.since_best = 0  # early stopping counts the model's own picks, not the initial design's

    def _propose(self, untried: list[Point]) -> Point:
        measured = [(p, v) for p, v in self.tried if v is not None and v > 0]
        if len(self.tried) < self.design_size or len(measured) < 2:
            return self._most_informative(untried, self._design)
        x = np.array([features(p) for p, _ in measured])
        y = np.log(np.array([v for _, v in measured]))
        coef = np.linalg.solve(x.T @ x + RIDGE * np.eye(x.shape[1]), x.T @ y)
        predicted = np.array([features(p) for p in untried]) @ coef
        return untried[int(np.argmax(predicted))]

    def _most_informative(self, untried: list[Point], design: np.ndarray) -> Point:
        """[Note: the initial design]."""
        row = {p: i for i, p in enumerate(self.points)}
        a = RIDGE * np.eye(design.shape[1])
        for p, _ in self.tried:
            x = design[row[p]]
            a += np.outer(x, x)
        inverse = np.linalg.inv(a)
        leverage = [float(design[row[p]] @ inverse @ design[row[p]]) for p in untried]
        return untried[int(np.argmax(leverage))]  # ties: the first in grid order


def _standardized(rows: list[list[float]]) -> np.ndarray:
    """Feature columns that vary over the candidates, each centred and scaled to unit spread."""
    x = np.array(rows, dtype=float)
    spread = x.std(axis=0)
    varying = spread > 1e-12
    return (x[:, varying] - x[:, varying].mean(axis=0)) / spread[varying]


TUNERS: dict[str, type[Tuner]] = {
    "gridsearch": GridSearchTuner,
    "random": RandomTuner,
    "model_based": ModelBasedTuner,
}


def build_tuner(
    kind: str, points: Sequence[Point], metric_name: str, early_stopping: int, num_trials: int, seed: int = 0
) -> Tuner:
    if kind not in TUNERS:
        raise ValueError(f"autotuning.tuner_type {kind!r}: expected one of {sorted(TUNERS)}")
    return TUNERS[kind](list(points), metric_name, early_stopping, num_trials, seed)
