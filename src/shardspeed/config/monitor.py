"""The monitor sections: ``tensorboard``, ``csv_monitor`` and ``wandb`` (DeepSpeed's keys and defaults, from
DeepSpeed 0.19's ``monitor/config.py``). What reads them: ``shardspeed/monitor/`` (``MonitorMaster``)."""

from __future__ import annotations

from .base import ConfigModel

__all__ = ["CsvMonitorConfig", "TensorBoardConfig", "WandbConfig", "any_monitor_enabled"]

DEFAULT_JOB_NAME = "DeepSpeedJobName"
"""DeepSpeed's default ``job_name``: the directory created inside ``output_path``."""


class TensorBoardConfig(ConfigModel):
    """``tensorboard``: scalars written with the ``tensorboard`` package's writer (needs ``shardspeed[monitor]``)."""

    enabled: bool = False
    """Write TensorBoard event files. DeepSpeed default: false."""

    output_path: str = ""
    """Directory the job's directory is created in; ``""`` means the launch directory. DeepSpeed default: ""."""

    job_name: str = DEFAULT_JOB_NAME
    """Name of the job's directory inside ``output_path``. DeepSpeed default: "DeepSpeedJobName"."""


class CsvMonitorConfig(ConfigModel):
    """``csv_monitor``: one CSV file per tag, ``{output_path}/{job_name}/{tag with / and space as _}.csv``."""

    enabled: bool = False
    """Write CSV files. DeepSpeed default: false."""

    output_path: str = ""
    """Directory the job's directory is created in; ``""`` means the launch directory. DeepSpeed default: ""."""

    job_name: str = DEFAULT_JOB_NAME
    """Name of the job's directory inside ``output_path``. DeepSpeed default: "DeepSpeedJobName"."""


class WandbConfig(ConfigModel):
    """``wandb``: a Weights & Biases run (needs ``shardspeed[monitor]``; ``WANDB_MODE=offline`` is honoured)."""

    enabled: bool = False
    """Log to W&B. DeepSpeed default: false."""

    group: str | None = None
    """W&B group of the run. DeepSpeed default: none."""

    team: str | None = None
    """W&B team (``wandb.init``'s ``entity``). DeepSpeed default: none."""

    project: str = "deepspeed"
    """W&B project. DeepSpeed default: "deepspeed"."""


def any_monitor_enabled(tensorboard: TensorBoardConfig, csv: CsvMonitorConfig, wandb: WandbConfig) -> bool:
    """Whether the config turns on any monitor (DeepSpeed's ``DeepSpeedMonitorConfig.enabled``)."""
    return tensorboard.enabled or csv.enabled or wandb.enabled
