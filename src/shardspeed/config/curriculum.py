"""``curriculum_learning``: DeepSpeed's legacy seqlen curriculum (DeepSpeed 0.19.6
``runtime/data_pipeline/config.py`` / ``constants.py``: same keys; 0.19.8 dropped the legacy section for
``data_efficiency``), and the schedule block both curricula share.

``CurriculumScheduleConfig`` is the schedule part (``min_difficulty``, ``max_difficulty``, ``schedule_type``,
``schedule_config``); ``data_efficiency``'s per-metric sections extend it. Its rules are the pure schedule's
(``data/curriculum/schedule.py``), applied at parse time so a bad key is a ConfigError naming it.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from shardspeed.data.curriculum.schedule import CurriculumSchedule, CurriculumScheduleError, schedule_problems

from .base import ConfigModel, Int, InvalidValue, PositiveFloat, PositiveInt


class ScheduleParamsConfig(ConfigModel):
    """``schedule_config``: the parameters of one schedule type (which ones apply depends on ``schedule_type``)."""

    total_curriculum_step: PositiveInt | None = None
    """``fixed_linear`` / ``fixed_root``: steps from ``min_difficulty`` to ``max_difficulty``. DeepSpeed: required
    there, no default."""

    difficulty_step: PositiveInt | None = None
    """``fixed_linear`` / ``fixed_root``: every difficulty is a multiple of it (8 for FP16 tensor cores; a warning
    otherwise). DeepSpeed: required there, no default."""

    root_degree: PositiveFloat | None = None
    """``fixed_root``: 2 is a square root, 1 is linear. DeepSpeed: required there, no default."""

    difficulty: list[Int] | None = None
    """``fixed_discrete``: the difficulties in order (one more entry than ``max_step``). DeepSpeed: required there."""

    max_step: list[Int] | None = None
    """``fixed_discrete``: the last step of each difficulty but the last. DeepSpeed: required there."""


class CurriculumScheduleConfig(ConfigModel):
    """A difficulty schedule: read by ``data.curriculum.schedule_from_config``."""

    SCHEDULE_REQUIRED: ClassVar[bool] = True
    """Whether the schedule keys must be present; a section with an ``enabled`` flag needs them only when on."""

    min_difficulty: Int | None = None
    """Difficulty at step 0 (a sequence length for ``curriculum_type: seqlen``). DeepSpeed: required."""

    max_difficulty: Int | None = None
    """Difficulty at the end of the curriculum. DeepSpeed: required."""

    schedule_type: Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"] | None = None
    """How difficulty grows with the global step; ``custom``: a function of the step, given to
    ``engine.curriculum_scheduler_legacy.set_custom_get_difficulty`` (the legacy ``curriculum_learning`` section) or
    ``engine.set_custom_curriculum_learning_schedule`` (``data_efficiency`` metrics). DeepSpeed: required."""

    schedule_config: ScheduleParamsConfig = Field(default_factory=ScheduleParamsConfig)
    """The schedule's parameters. DeepSpeed: required except for ``custom``."""

    def schedule_in_use(self) -> bool:
        return self.SCHEDULE_REQUIRED

    @model_validator(mode="after")
    def _schedule_is_usable(self) -> CurriculumScheduleConfig:
        if self.schedule_in_use():
            self.check_schedule()
        return self

    def check_schedule(self) -> None:
        """Raise ``InvalidValue`` naming the first missing or inconsistent schedule key."""
        for key in ("min_difficulty", "max_difficulty", "schedule_type"):
            if getattr(self, key) is None:
                raise InvalidValue(key, "required when curriculum learning is enabled")
        p = self.schedule_config
        probe = CurriculumSchedule.__new__(CurriculumSchedule)  # validate without raising on the first rule
        for name, value in (
            ("min_difficulty", self.min_difficulty),
            ("max_difficulty", self.max_difficulty),
            ("schedule_type", self.schedule_type),
            ("total_curriculum_step", p.total_curriculum_step),
            ("difficulty_step", p.difficulty_step),
            ("root_degree", p.root_degree),
            ("difficulty", tuple(p.difficulty or ())),
            ("max_step", tuple(p.max_step or ())),
        ):
            object.__setattr__(probe, name, value)
        for key, problem in schedule_problems(probe):
            raise InvalidValue(key, problem)


class CurriculumLearningConfig(CurriculumScheduleConfig):
    """``curriculum_learning``: DeepSpeed's legacy curriculum. With ``curriculum_type: seqlen`` the engine's forward
    passes ``curriculum_seqlen=<difficulty>`` to the model (DeepSpeed's behaviour), or with shardspeed's
    ``truncate`` cuts the batch's sequence dimension itself (training/curriculum.py)."""

    enabled: bool = False
    """Turn the curriculum on. DeepSpeed default: false."""

    curriculum_type: str = "seqlen"
    """What the difficulty means. Only ``seqlen`` (sequence length): DeepSpeed's engine acts on no other value (it
    silently does nothing for others; shardspeed refuses them). Not a default in DeepSpeed (its scripts always write
    ``seqlen``)."""

    truncate: bool = False
    """Not a DeepSpeed key. False (DeepSpeed's behaviour): the model's forward receives ``curriculum_seqlen`` and
    truncates itself. True: the engine cuts every dim >= 1 equal to ``max_difficulty`` (the full sequence length) of
    every batch tensor of dim >= 2 to its first ``difficulty`` positions (contiguous; ``[b, s, s]`` masks become
    ``[b, d, d]``) before the forward (under a pipeline: the first stage's inputs and the last stage's labels), and
    passes no ``curriculum_seqlen``; a batch with no such dim while the difficulty is below the maximum is an error."""

    def schedule_in_use(self) -> bool:
        return self.enabled

    @model_validator(mode="after")
    def _seqlen_only(self) -> CurriculumLearningConfig:
        if self.enabled and self.min_difficulty is not None and self.min_difficulty < 1:
            raise InvalidValue(
                "min_difficulty",
                f'"{{path}}" = {self.min_difficulty} would feed empty sequences: a sequence length must be at least 1',
            )
        if self.enabled and self.curriculum_type != "seqlen":
            raise InvalidValue(
                "curriculum_type",
                f'"{{path}}" = {self.curriculum_type!r} is not supported: the legacy curriculum implements only '
                '"seqlen" (sequence-length curriculum); for metric-based curricula use data_efficiency.data_sampling',
            )
        return self


__all__ = ["CurriculumLearningConfig", "CurriculumScheduleConfig", "CurriculumScheduleError", "ScheduleParamsConfig"]
