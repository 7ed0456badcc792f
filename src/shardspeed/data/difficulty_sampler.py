"""The difficulty-aware sampler of ``data_efficiency.data_sampling.curriculum_learning``: each global batch is drawn
from the samples eligible at the current difficulty of every metric (data/difficulty.py), then cut per data rank.

[Note: difficulty sampler order] Everything is a pure function of (seed, metric files, train_batch_size) and the
global batch index, so every rank computes the same global batches with no communication and no rank-0 file writes
(DeepSpeed: rank 0 draws, writes cluster files and broadcasts each batch). Global batch ``g`` (curriculum step
``g + 1``, DeepSpeed's count) first updates each metric's difficulty (``next_difficulties``, DeepSpeed's sticky
rule); eligibility is evaluated at each metric's *running maximum* difficulty, so the eligible set never shrinks
(DeepSpeed's clusters only accumulate), and ``single_cluster`` metrics filter nothing.

Samples are taken in *rounds*. Round ``r`` fixes a permutation of all N samples, seeded by ``(seed, r)``, and a
*consumed* set (empty when the round starts). A global batch is the first ``train_batch_size`` samples, in the
round's permutation order, that are eligible now and not yet consumed; they become consumed. So
- no sample repeats while an eligible sample not yet drawn in the round remains; a difficulty change that adds no
  sample (a ``single_cluster`` metric, an empty value step) changes nothing;
- at full difficulty — reached directly or after a ramp — every sample is drawn exactly once per round, and a round
  is an epoch of the dataset (the samples drawn during the ramp count towards it);
- when the eligible samples not yet consumed run out (fewer left than the batch needs), the batch takes them all,
  the round ends, and the rest of the batch comes from the next round (new permutation, nothing consumed): as
  DeepSpeed reshuffles a cluster it has used up. Only there can a sample repeat, and inside one global batch only
  when fewer samples are eligible than two batches hold.
Cost: O(N) per change of the eligible set or per round, O(train_batch_size) per batch otherwise.
The position (global batch index, round, difficulties, running maxima, consumed set as a packed bitmap, samples
consumed in the current global batch) is the checkpointed state with a fingerprint of each metric's files; it
means the same at every world size.

A global batch is laid out as ``GlobalIndexSampler`` lays it out (data/sampler.py): micro-step by micro-step,
rank by rank inside a micro-step. One iteration of the loader is ``num_epochs × (len(dataset) //
train_batch_size)`` global batches (DeepSpeed's sampler length: ``num_epochs × len(dataset)`` samples); iterating
again continues the curriculum where it stopped.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardspeed.data.difficulty import MetricCurriculum, eligible_mask, next_difficulties

KIND = "difficulty"
Levels = tuple[tuple[str, int], ...]


@dataclass(frozen=True, eq=False)
class Cursor:
    """Where the draw stands before global batch ``batch``. The consumed set of round ``round`` is ``consumed``
    (by position in the round's permutation) plus the positions ``candidates[:taken]``; ``candidates`` are the
    positions eligible and unconsumed when the eligible set last changed, in order. Arrays are shared, never
    written."""

    batch: int
    round: int
    difficulties: Levels | None
    reached: Levels | None
    consumed: np.ndarray
    candidates: np.ndarray
    taken: int

    def consumed_positions(self) -> np.ndarray:
        out = self.consumed.copy()
        out[self.candidates[: self.taken]] = True
        return out


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _levels(values: Mapping[str, int]) -> Levels:
    return tuple(sorted((k, int(v)) for k, v in values.items()))


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
        empty = np.zeros(0, dtype=np.int64)
        self._cursor = Cursor(0, 0, None, None, np.zeros(self.num_samples, dtype=bool), empty, 0)
        self._micro = 0  # micro-steps of the current global batch already consumed
        self._draws: dict[int, tuple[Cursor, np.ndarray, Cursor]] = {}
        self._perm: tuple[int, np.ndarray] | None = None
        self._eligible: tuple[tuple[int, Levels], np.ndarray] | None = None

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

    def _permutation(self, round_: int) -> np.ndarray:
        cached = self._perm  # one read: the prefetch thread and the consumer both draw
        if cached is None or cached[0] != round_:
            cached = (round_, np.random.default_rng([self.seed, round_]).permutation(self.num_samples))
            self._perm = cached
        return cached[1]

    def _filtering(self, reached: Mapping[str, int]) -> Levels:
        """The part of the running maxima that decides eligibility (``single_cluster`` metrics filter nothing)."""
        return tuple(sorted((m.name, int(reached[m.name])) for m in self.metrics if m.index is not None))

    def _eligible_in_order(self, round_: int, reached: Mapping[str, int]) -> np.ndarray:
        """Per position of round ``round_``'s permutation: whether that sample is eligible at ``reached``."""
        key = (round_, self._filtering(reached))
        cached = self._eligible
        if cached is None or cached[0] != key:
            mask = eligible_mask(self.metrics, reached, self.num_samples)
            if not mask.any():
                raise ValueError(
                    f"no sample is eligible at the curriculum difficulties {dict(reached)}: lower min_difficulty "
                    "or check the metric files (shardspeed data-analyze prints each metric's range)"
                )
            cached = (key, mask[self._permutation(round_)])
            self._eligible = cached
        return cached[1]

    def draw(self, cursor: Cursor) -> tuple[np.ndarray, Cursor]:
        """Global batch ``cursor.batch`` and the cursor after it."""
        hit = self._draws.get(id(cursor))
        if hit is not None and hit[0] is cursor:
            return hit[1], hit[2]
        old = dict(cursor.difficulties) if cursor.difficulties is not None else None
        new = next_difficulties(self.metrics, old, cursor.batch + 1, self.custom)
        before = dict(cursor.reached) if cursor.reached is not None else None
        reached = new if before is None else {k: max(v, before[k]) for k, v in new.items()}
        round_, consumed, candidates, taken = cursor.round, cursor.consumed, cursor.candidates, cursor.taken
        if before is None or self._filtering(before) != self._filtering(reached):
            consumed = cursor.consumed_positions()
            candidates, taken = np.flatnonzero(self._eligible_in_order(round_, reached) & ~consumed), 0
        parts, need = [], self.train_batch_size
        while need:
            if taken >= len(candidates):  # the eligible samples of this round are used up: the next round
                round_, consumed, taken = round_ + 1, np.zeros(self.num_samples, dtype=bool), 0
                candidates = np.flatnonzero(self._eligible_in_order(round_, reached))
            take = candidates[taken : taken + need]
            parts.append(self._permutation(round_)[take])
            taken, need = taken + len(take), need - len(take)
        after = Cursor(cursor.batch + 1, round_, _levels(new), _levels(reached), consumed, candidates, taken)
        batch = np.concatenate(parts)
        if len(self._draws) > 8:
            self._draws.clear()
        self._draws[id(cursor)] = (cursor, batch, after)
        return batch, after

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

    def delivered_difficulties(self) -> dict[str, int]:
        """Difficulties of the global batch the next micro-batch belongs to (the one being delivered)."""
        return dict(self.draw(self._cursor)[1].difficulties or ())

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

    def fingerprints(self) -> dict[str, int]:
        """A crc32 of each filtering metric's rows (a resumed run must read the same files)."""
        return {m.name: m.index.fingerprint() for m in self.metrics if m.index is not None}

    def delivery_state(self) -> dict[str, Any]:
        """What ``set_data_post_process_func``'s hook receives: the position without the drawn set, and
        ``current_difficulties`` of the global batch being delivered (DeepSpeed's key)."""
        return self.state_dict(with_consumed=False)

    def state_dict(self, with_consumed: bool = True) -> dict[str, Any]:
        c = self._cursor
        packed = ""
        if with_consumed:
            consumed = np.zeros(self.num_samples, dtype=bool)
            consumed[self._permutation(c.round)[c.consumed_positions()]] = True
            packed = base64.b64encode(zlib.compress(np.packbits(consumed).tobytes())).decode("ascii")
        return {
            "kind": KIND,
            "global_batches": c.batch,
            "round": c.round,
            "consumed": packed,
            "difficulties": dict(c.difficulties) if c.difficulties is not None else None,
            "reached_difficulties": dict(c.reached) if c.reached is not None else None,
            "current_difficulties": self.delivered_difficulties(),
            "samples_consumed_in_batch": self._micro * self.samples_per_micro_step,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "train_batch_size": self.train_batch_size,
            "metrics": sorted(m.name for m in self.metrics),
            "fingerprints": self.fingerprints(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position, possibly saved at another world size (same train_batch_size)."""
        if state.get("kind") != KIND or "round" not in state:
            raise ValueError(
                "the checkpoint's data loader state is not a difficulty sampler's (it was saved without "
                "data_efficiency curriculum sampling, or by an older shardspeed); its position cannot be continued"
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
        for metric in self.metrics:
            saved = state["fingerprints"].get(metric.name)
            if metric.index is not None and saved != metric.index.fingerprint():
                raise ValueError(
                    f"curriculum metric {metric.name!r}: its files ({metric.source or 'index_to_sample_path'}) "
                    "differ from those the checkpoint was saved with (fingerprint mismatch); the global batches "
                    "would differ, so the position cannot be restored — point the metric at the original files"
                )
        consumed = int(state["samples_consumed_in_batch"])
        if consumed % self.samples_per_micro_step:
            raise ValueError(
                f"difficulty sampler state: {consumed} samples of the current global batch were consumed, not a whole "
                f"number of micro-steps of {self.samples_per_micro_step} samples; resume from a step boundary"
            )
        self.seed = int(state["seed"])
        self._draws.clear()
        self._perm = self._eligible = None
        round_ = int(state["round"])
        bits = np.frombuffer(zlib.decompress(base64.b64decode(state["consumed"])), dtype=np.uint8)
        taken = np.unpackbits(bits, count=self.num_samples).astype(bool)[self._permutation(round_)]
        d, r = state["difficulties"], state["reached_difficulties"]
        candidates = np.zeros(0, dtype=np.int64)
        if r is not None:
            candidates = np.flatnonzero(self._eligible_in_order(round_, r) & ~taken)
        self._cursor = Cursor(
            int(state["global_batches"]),
            round_,
            _levels(d) if d is not None else None,
            _levels(r) if r is not None else None,
            taken,
            candidates,
            0,
        )
        self._micro = consumed // self.samples_per_micro_step
