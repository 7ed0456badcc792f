"""The tuning space (pure): which configurations a tune may try, expanded from the user's config.

Dimensions, each read from the user's DeepSpeed config where DeepSpeed keeps it (a concrete value is fixed, a list
is the values to try, ``"auto"`` or absence lets the tuner choose):
- ZeRO stage (``zero_optimization.stage``; auto: 0-3),
- micro-batch size (``train_micro_batch_size_per_gpu``; auto: powers of two between the ``autotuning`` section's
  ``min/max_train_micro_batch_size_per_gpu``, thinned to ``num_tuning_micro_batch_sizes`` after memory pruning),
- gradient accumulation (``gradient_accumulation_steps``; with a fixed ``train_batch_size`` it follows from the
  micro-batch; auto: 1), bounded by ``min/max_train_batch_size``,
- bucket sizes and overlap (``reduce_bucket_size``, ``allgather_bucket_size``, ``overlap_comm``; auto, or absent
  with ``fast: false``: DeepSpeed's own lists),
- optimizer / parameter offload (``offload_optimizer.device`` / ``offload_param.device``: none, cpu, nvme where
  an ``nvme_path`` is given; auto, or absent with ``fast: false``: none and cpu),
- activation checkpointing on/off: a script argument (``arg_mappings["activation_checkpointing"]``, e.g.
  ``"--checkpoint_activations"``), tried both ways when mapped.

Every point becomes a concrete config (``materialize``) that ``ShardSpeedConfig`` validates before anything runs
(``expand`` drops points it refuses, counted with the reason).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from shardspeed.config.autotuning import AutotuningConfig
from shardspeed.config.errors import ConfigError
from shardspeed.config.load import load_config

__all__ = ["Point", "Space", "SpaceError", "expand", "materialize", "micro_batch_ladder", "thin_micro_batches"]

AUTO = "auto"
DEEPSPEED_BUCKETS = (50_000_000, 500_000_000, 1_000_000_000)  # DeepSpeed's DEFAULT_TUNING_SPACE_ZERO_1..3
AC_ARG = "activation_checkpointing"
"""The ``arg_mappings`` key of the activation-checkpointing switch (a flag of the script)."""


class SpaceError(ValueError):
    """A tuning-space value the tuner cannot expand (names the key)."""


@dataclass(frozen=True, order=True)
class Point:
    """One configuration of the space; ``None`` leaves that key as the user's config has it."""

    stage: int
    micro_batch: int
    gas: int
    offload_optimizer: str = "none"
    offload_param: str = "none"
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    overlap_comm: bool | None = None
    checkpoint_activations: bool | None = None

    @property
    def name(self) -> str:
        """A short, file-name-safe id: ``z2_mb8_gas1_oo-cpu_ac``."""
        parts = [f"z{self.stage}", f"mb{self.micro_batch}", f"gas{self.gas}"]
        if self.offload_optimizer != "none":
            parts.append(f"oo-{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"op-{self.offload_param}")
        if self.reduce_bucket_size is not None:
            parts.append(f"rb{self.reduce_bucket_size:.0e}".replace("+", ""))
        if self.allgather_bucket_size is not None:
            parts.append(f"ab{self.allgather_bucket_size:.0e}".replace("+", ""))
        if self.overlap_comm is not None:
            parts.append("ov" if self.overlap_comm else "noov")
        if self.checkpoint_activations:
            parts.append("ac")
        return "_".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Space:
    points: tuple[Point, ...]
    """Valid points, in grid order (stage, then micro-batch, ...)."""
    invalid: tuple[tuple[str, str], ...]
    """(point name, why) for points the strict config or the batch bounds refused."""


def _values(value: Any, key: str, auto: Iterable[Any]) -> list[Any]:
    """A user value as the list of values to try: a list as is, "auto" → ``auto``, a scalar → itself."""
    if isinstance(value, str) and value.lower() == AUTO:
        return list(auto)
    if isinstance(value, list):
        if not value:
            raise SpaceError(f"{key}: an empty list leaves nothing to try")
        return list(value)
    return [value]


def micro_batch_ladder(low: int, high: int) -> list[int]:
    """Powers of two from ``low`` to ``high``, plus both ends (DeepSpeed sweeps micro-batches the same way)."""
    out = {low, high}
    power = 1
    while power <= high:
        if power >= low:
            out.add(power)
        power *= 2
    return sorted(out)


def thin_micro_batches(micro_batches: list[int], count: int) -> list[int]:
    """``count`` micro-batches spread evenly over the sorted feasible ones, always keeping the largest (DeepSpeed's
    ``num_tuning_micro_batch_sizes`` rule: larger micro-batches are usually faster, the smallest is the safe
    bet). Pure."""
    values = sorted(set(micro_batches))
    if len(values) <= count:
        return values
    if count == 1:
        return [values[-1]]
    step = (len(values) - 1) / (count - 1)
    return sorted({values[round(i * step)] for i in range(count)})


def _offload_choices(section: Any, key: str, fast: bool, nvme_ok: bool) -> list[str]:
    device = section.get("device") if isinstance(section, dict) else None
    if device is None:
        return ["none"] if fast else ["none", "cpu"]
    auto = ["none", "cpu", "nvme"] if nvme_ok else ["none", "cpu"]
    return [str(v) for v in _values(device, f"zero_optimization.{key}.device", auto)]


def _stage_choices(zero: dict[str, Any]) -> list[int]:
    return [int(v) for v in _values(zero.get("stage", AUTO), "zero_optimization.stage", (0, 1, 2, 3))]


def expand_points(user: dict[str, Any], tuning: AutotuningConfig, dp_world: int) -> Iterator[tuple[Point, str]]:
    """Every combination of the dimensions, with "" or the reason a point breaks the batch rules (pure)."""
    zero = dict(user.get("zero_optimization") or {})
    fast = tuning.fast
    stages = _stage_choices(zero)
    mbs = [
        int(v)
        for v in _values(
            user.get("train_micro_batch_size_per_gpu", AUTO),
            "train_micro_batch_size_per_gpu",
            micro_batch_ladder(tuning.min_train_micro_batch_size_per_gpu, tuning.max_train_micro_batch_size_per_gpu),
        )
    ]
    tbs = user.get("train_batch_size", AUTO)
    fixed_tbs = None if isinstance(tbs, (str, list)) else int(tbs)
    gas_values = [int(v) for v in _values(user.get("gradient_accumulation_steps", AUTO), "gas", (1,))]
    nvme_ok = any(
        isinstance(zero.get(k), dict) and zero[k].get("nvme_path") for k in ("offload_optimizer", "offload_param")
    )
    oo = _offload_choices(zero.get("offload_optimizer"), "offload_optimizer", fast, nvme_ok)
    op = _offload_choices(zero.get("offload_param"), "offload_param", fast, nvme_ok)

    def tuned(key: str, auto: Iterable[Any]) -> list[Any]:
        if key in zero:
            return _values(zero[key], f"zero_optimization.{key}", auto)
        return [None] if fast else list(auto)

    rb = tuned("reduce_bucket_size", DEEPSPEED_BUCKETS)
    ab = tuned("allgather_bucket_size", DEEPSPEED_BUCKETS)
    ov = tuned("overlap_comm", (True, False))
    ac: list[bool | None] = [False, True] if tuning.arg_mappings and AC_ARG in tuning.arg_mappings else [None]
    dp = max(1, dp_world // tuning.mp_size)
    for stage, mb, o_opt, o_par, r, a, v, c in itertools.product(stages, mbs, oo, op, rb, ab, ov, ac):
        if o_opt == "none" and o_par != "none":
            continue  # parameter offload streams through the offloaded optimizer here: not a point of its own
        if (o_par != "none" and stage != 3) or (o_opt != "none" and stage == 0):
            continue  # offload needs the partitions of stage >= 1 (parameters: stage 3)
        if stage < 2 and v is not None and v is not ov[0]:
            continue  # overlap_comm matters once gradients are partitioned: try one value below stage 2
        if stage == 0 and ((r is not None and r != rb[0]) or (a is not None and a != ab[0])):
            continue
        for gas in [fixed_tbs // (mb * dp)] if fixed_tbs is not None else gas_values:
            point = Point(stage, mb, max(gas, 1), o_opt, o_par, _int(r), _int(a), v, c)
            yield point, _batch_problem(point, dp, fixed_tbs, tuning)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _batch_problem(point: Point, dp: int, fixed_tbs: int | None, tuning: AutotuningConfig) -> str:
    batch = point.micro_batch * point.gas * dp
    if fixed_tbs is not None and batch != fixed_tbs:
        return f"train_batch_size {fixed_tbs} is not micro-batch {point.micro_batch} × GAS × {dp} ranks"
    if batch < tuning.min_train_batch_size:
        return f"global batch {batch} < min_train_batch_size {tuning.min_train_batch_size}"
    if tuning.max_train_batch_size is not None and batch > tuning.max_train_batch_size:
        return f"global batch {batch} > max_train_batch_size {tuning.max_train_batch_size}"
    return ""


def materialize(user: dict[str, Any], point: Point, dp_world: int) -> dict[str, Any]:
    """The concrete DeepSpeed config of ``point``: the user's config with every tuned key set (pure)."""
    config = json.loads(json.dumps(user))
    config["train_micro_batch_size_per_gpu"] = point.micro_batch
    config["gradient_accumulation_steps"] = point.gas
    config.pop("train_batch_size", None)  # implied by the two above and the world: never contradicts them
    zero = dict(config.get("zero_optimization") or {})
    zero["stage"] = point.stage
    for key in ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm"):
        value = getattr(point, key)
        if value is not None:
            zero[key] = value
        elif isinstance(zero.get(key), (list, str)):
            zero.pop(key)  # "auto" / a list the point does not choose: the engine's default
    for key, device in (("offload_optimizer", point.offload_optimizer), ("offload_param", point.offload_param)):
        section = dict(zero.get(key) or {})
        if device == "none":
            zero.pop(key, None)
        else:
            section["device"] = device
            zero[key] = section
    config["zero_optimization"] = zero
    return config


def validate(config: dict[str, Any], dp_world: int) -> str:
    """ "" when the strict config accepts ``config`` for ``dp_world`` ranks, else its error (first line)."""
    try:
        load_config(config, dp_world_size=dp_world)
    except (ConfigError, ValueError) as error:
        return str(error).splitlines()[0]
    return ""


def expand(user: dict[str, Any], tuning: AutotuningConfig, dp_world: int) -> Space:
    """All valid points of the user's space; invalid ones with their reason (see the module docstring)."""
    points: list[Point] = []
    invalid: list[tuple[str, str]] = []
    seen: set[Point] = set()
    for point, problem in expand_points(user, tuning, dp_world):
        if point in seen:
            continue
        seen.add(point)
        problem = problem or validate(materialize(user, point, dp_world), dp_world)
        if problem:
            invalid.append((point.name, problem))
        else:
            points.append(point)
    return Space(tuple(points), tuple(invalid))
