"""The difficulty-aware sampler of ``data_efficiency.data_sampling.curriculum_learning``: each global batch is drawn
from the samples eligible at the current difficulty of every metric (data/difficulty.py), then cut per data rank.

[Note: difficulty sampler order] Everything is a pure function of (seed, metric files, train_batch_size) and the
global batch index, so every rank computes the same global batches with no communication and no rank-0 file writes
(DeepSpeed: rank 0 draws, writes cluster files and broadcasts each batch). Global batch ``g`` (curriculum step
``g + 1``, DeepSpeed's count) first updates each metric's difficulty (``next_difficulties``). Samples are taken in
*passes*: a pass is a permutation of the eligible set, seeded by ``(seed, pass id)``. A change of difficulty starts
a new pass over the new eligible set; otherwise the batch continues the current pass, and a pass that runs out
mid-batch is followed by the next pass over the same set. So at a fixed difficulty every eligible sample is drawn
exactly once per pass (at full difficulty: once per epoch of the dataset), and samples repeat only when the
eligible set is smaller than what training consumes — as in DeepSpeed, whose clusters are reshuffled when used up.
The position (global batch index, pass id, position in the pass, difficulties, samples consumed in the current
global batch) is the checkpointed state; it means the same at every world size.

A global batch is laid out as ``GlobalIndexSampler`` lays it out (data/sampler.py): micro-step by micro-step,
rank by rank inside a micro-step. One iteration of the loader is ``num_epochs × (len(dataset) //
train_batch_size)`` global batches (DeepSpeed's sampler length: ``num_epochs × len(dataset)`` samples); iterating
again continues the curriculum where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardspeed.data.difficulty import MetricCurriculum, eligible_samples, next_difficulties

KIND = "difficulty"


@dataclass(frozen=True)
class Cursor:
    """Where the draw stands before global batch ``batch``."""

    batch: int
    pass_id: int
    position: int
    difficulties: tuple[tuple[str, int], ...] | None


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class DifficultySampler:
    """Batch sampler yielding this rank's micro-batches of difficulty-drawn global batches (same protocol as
    ``GlobalIndexSampler``: iterating does not move the position; ``advance`` does)."""

    def __init__(
        self,
        metrics: tuple[MetricCurriculum, ...],
        num_samples: int,
        *,
        micro_batch_size: int,
        gradient_accumulation_steps: int,
        dp_rank: int,
        dp_world_size: int,
        seed: int = 1234,
        num_epochs: int = 1,
    ) -> None:
        if not metrics:
            raise ValueError("the difficulty sampler needs at least one curriculum metric")
        self.metrics = metrics
        self.num_samples = _positive("num_samples", num_samples)
        self.micro_batch_size = _positive("micro_batch_size", micro_batch_size)
        self.gradient_accumulation_steps = _positive("gradient_accumulation_steps", gradient_accumulation_steps)
        self.dp_world_size = _positive("dp_world_size", dp_world_size)
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank must be an integer in [0, {dp_world_size}), got {dp_rank!r}")
        self.dp_rank = dp_rank
        self.seed = seed
        self.num_epochs = _positive("num_epochs", num_epochs)
        self.train_batch_size = self.micro_batch_size * self.gradient_accumulation_steps * self.dp_world_size
        self.custom: dict[str, Callable[[int], int]] = {}
        self._cursor = Cursor(0, -1, 0, None)
        self._micro = 0  # micro-steps of the current global batch already consumed
        self._draws: dict[Cursor, tuple[np.ndarray, Cursor]] = {}
        self._order_cache: tuple[tuple[int, tuple[tuple[str, int], ...]], np.ndarray] | None = None

    # ---- geometry ------------------------------------------------------------------------------------------------
    @property
    def samples_per_micro_step(self) -> int:
        return self.micro_batch_size * self.dp_world_size

    @property
    def batches_per_iteration(self) -> int:
        return self.num_epochs * max(1, self.num_samples // self.train_batch_size)

    def __len__(self) -> int:
        """Micro-batches this rank reads in one iteration."""
        return self.batches_per_iteration * self.gradient_accumulation_steps

    # ---- the draw (pure in the cursor) ---------------------------------------------------------------------------
    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Mapping[str, Callable[[int], int]]) -> None:
        """DeepSpeed's API: metric name -> ``fn(step) -> difficulty`` for ``schedule_type: custom``."""
        unknown = set(schedule_func_dict) - {m.name for m in self.metrics}
        if unknown:
            raise ValueError(f"custom schedules for unknown metrics {sorted(unknown)}")
        self.custom.update(schedule_func_dict)
        self._draws.clear()

    def _order(self, pass_id: int, difficulties: tuple[tuple[str, int], ...]) -> np.ndarray:
        key = (pass_id, difficulties)
        cached = self._order_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        eligible = eligible_samples(self.metrics, dict(difficulties), self.num_samples)
        if len(eligible) == 0:
            raise ValueError(
                f"no sample is eligible at the curriculum difficulties {dict(difficulties)}: lower min_difficulty "
                "or check the metric files (shardspeed data-analyze prints each metric's range)"
            )
        order = np.random.default_rng([self.seed, pass_id]).permutation(eligible)
        self._order_cache = (key, order)
        return order

    def draw(self, cursor: Cursor) -> tuple[np.ndarray, Cursor]:
        """Global batch ``cursor.batch`` and the cursor after it."""
        hit = self._draws.get(cursor)
        if hit is not None:
            return hit
        old = dict(cursor.difficulties) if cursor.difficulties is not None else None
        new = next_difficulties(self.metrics, old, cursor.batch + 1, self.custom)
        difficulties = tuple(sorted(new.items()))
        pass_id, position = cursor.pass_id, cursor.position
        if difficulties != cursor.difficulties:
            pass_id, position = pass_id + 1, 0
        parts, need = [], self.train_batch_size
        while need:
            order = self._order(pass_id, difficulties)
            take = order[position : position + need]
            parts.append(take)
            need -= len(take)
            position += len(take)
            if position >= len(order):
                pass_id, position = pass_id + 1, 0
        result = (np.concatenate(parts), Cursor(cursor.batch + 1, pass_id, position, difficulties))
        if len(self._draws) > 8:
            self._draws.clear()
        self._draws[cursor] = result
        return result

    def global_batches(self, count: int, start: Cursor | None = None) -> list[np.ndarray]:
        """The next ``count`` global batches from ``start`` (default: the current position's batch)."""
        cursor, out = start or self._cursor, []
        for _ in range(count):
            batch, cursor = self.draw(cursor)
            out.append(batch)
        return out

    @property
    def current_difficulties(self) -> dict[str, int] | None:
        """Difficulties of the global batch last consumed (None before the first)."""
        d = self._cursor.difficulties
        return dict(d) if d is not None else None

    # ---- iteration and position ----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        return self._rank_micro_batches(self._cursor, self._micro)

    def _rank_micro_batches(self, cursor: Cursor, first_micro: int) -> Iterator[list[int]]:
        end = (cursor.batch // self.batches_per_iteration + 1) * self.batches_per_iteration
        offset = self.dp_rank * self.micro_batch_size
        while cursor.batch < end:
            batch, after = self.draw(cursor)
            for micro in range(first_micro, self.gradient_accumulation_steps):
                first = micro * self.samples_per_micro_step + offset
                yield batch[first : first + self.micro_batch_size].tolist()
            first_micro, cursor = 0, after

    def advance(self, micro_steps: int = 1) -> None:
        """Every rank consumed ``micro_steps`` more micro-batches."""
        self._micro += micro_steps
        while self._micro >= self.gradient_accumulation_steps:
            self._cursor = self.draw(self._cursor)[1]
            self._micro -= self.gradient_accumulation_steps

    def start_next_epoch(self) -> None:
        """Nothing to reset: the next iteration continues the curriculum (the position is absolute)."""

    def state_dict(self) -> dict[str, Any]:
        c = self._cursor
        return {
            "kind": KIND,
            "global_batches": c.batch,
            "pass": c.pass_id,
            "pass_position": c.position,
            "difficulties": dict(c.difficulties) if c.difficulties is not None else None,
            "samples_consumed_in_batch": self._micro * self.samples_per_micro_step,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "train_batch_size": self.train_batch_size,
            "metrics": sorted(m.name for m in self.metrics),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position, possibly saved at another world size (same train_batch_size)."""
        if state.get("kind") != KIND:
            raise ValueError(
                "the checkpoint's data loader state is not a difficulty sampler's (it was saved without "
                "data_efficiency curriculum sampling); its position cannot be continued by this sampler"
            )
        checks = (
            ("num_samples", self.num_samples),
            ("metrics", sorted(m.name for m in self.metrics)),
            ("train_batch_size", self.train_batch_size),
        )
        for key, mine in checks:
            if state[key] != mine:
                raise ValueError(
                    f"difficulty sampler state was saved with {key} = {state[key]!r} but this run has {mine!r}; the "
                    "global batches would differ, so the position cannot be restored"
                )
        consumed = int(state["samples_consumed_in_batch"])
        if consumed % self.samples_per_micro_step:
            raise ValueError(
                f"difficulty sampler state: {consumed} samples of the current global batch were consumed, not a whole "
                f"number of micro-steps of {self.samples_per_micro_step} samples; resume from a step boundary"
            )
        d = state["difficulties"]
        self.seed = int(state["seed"])
        self._draws.clear()
        self._order_cache = None
        self._cursor = Cursor(
            int(state["global_batches"]),
            int(state["pass"]),
            int(state["pass_position"]),
            tuple(sorted((k, int(v)) for k, v in d.items())) if d is not None else None,
        )
        self._micro = consumed // self.samples_per_micro_step
