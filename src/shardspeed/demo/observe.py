"""The demo's observability: its run directory, the monitor and profiler sections of its config, the MFU line of
its summary and the report it ends with — all through the public surface a DeepSpeed user has (config keys,
``engine.monitor``, ``engine.flops_profiler``, ``shardspeed report``).

[Note: sections the config may not know yet] The monitor (``tensorboard``, ``csv_monitor``, ``wandb``) and
``flops_profiler`` sections are typed config sections in builds that implement them; a build that does not
refuses them with ``enabled: true``. The demo adds each section only when ``ShardSpeedConfig`` has it as a
field, so the same demo runs (and reports what it has) either way.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MONITOR_SECTIONS = ("tensorboard", "csv_monitor")
JOB_NAME = "demo"


def default_run_dir(now: float | None = None, root: Path = Path("runs")) -> Path:
    """``runs/demo-<UTC timestamp>`` under the current directory, created here: the stamp has one-second
    resolution, so a second demo started in the same second claims ``demo-<stamp>-2`` (mkdir is atomic) instead
    of sharing, and appending to, the first one's logs."""
    stamp = time.strftime("demo-%Y%m%d-%H%M%S", time.gmtime(now))
    root.mkdir(parents=True, exist_ok=True)
    suffix = 1
    while True:
        path = root / (stamp if suffix == 1 else f"{stamp}-{suffix}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            suffix += 1


def agree_run_dir(requested: str | None, device: torch.device | None) -> Path:
    """The run directory every rank uses: ``requested``, else rank 0's default, broadcast (a worker started by a
    launcher without ``--run-dir``; the relauncher always passes one)."""
    if requested:
        return Path(requested)
    chosen: list[Any] = [str(default_run_dir())]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(chosen, src=0, device=device)
    return Path(chosen[0])


def known_sections() -> set[str]:
    from shardspeed.config import ShardSpeedConfig

    return set(ShardSpeedConfig.model_fields)


def observability_sections(run_dir: Path, steps: int, wandb: bool = False) -> dict[str, Any]:
    """The monitors under ``run_dir`` and the flops profiler at an early step ([Note: sections the config may not
    know yet]). The profiler takes the step after ``profile_step`` steps; 2 skips the first step, which also
    records the gradients' arrival order."""
    known = known_sections()
    sections: dict[str, Any] = {}
    for name in MONITOR_SECTIONS:
        if name in known:
            folder = "tensorboard" if name == "tensorboard" else "csv"
            sections[name] = {"enabled": True, "output_path": str(run_dir / folder), "job_name": JOB_NAME}
    if wandb and "wandb" in known:
        sections["wandb"] = {"enabled": True, "project": "shardspeed-demo", "group": run_dir.name}
    if "flops_profiler" in known:
        sections["flops_profiler"] = {
            "enabled": True,
            "profile_step": max(0, min(2, steps - 1)),
            "module_depth": 2,
            "top_modules": 3,
            "detailed": False,
            "output_file": str(run_dir / "flops_profile.txt"),
        }
    return sections


def prepare_run_dir(run_dir: Path, config: dict[str, Any], is_rank0: bool, wandb: bool) -> None:
    """Create ``run_dir`` and write ``ds_config.json`` (the config as given to ``initialize``). W&B goes offline
    into the run directory unless the environment already chose (``WANDB_MODE`` / ``WANDB_DIR``)."""
    if wandb:
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", str(run_dir))
    if is_rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "ds_config.json").write_text(json.dumps(config, indent=2) + "\n")


def mfu_line(engine: Any, samples_per_second: float, devices: int) -> str:
    """The summary's MFU row (S5's API): achieved model FLOPs / (devices × peak), or why there is none."""
    profiler = getattr(engine, "flops_profiler", None)
    if profiler is None:
        return "n/a (this build has no flops profiler)"
    flops = getattr(profiler, "model_flops_per_sample", None)
    if flops is None:
        return "n/a (the flops profiler did not run: its profile_step was not reached)"
    from shardspeed.profiling.mfu import model_flops_utilization

    peak = profiler.peak_flops
    mfu = model_flops_utilization(flops, samples_per_second, devices, peak)
    return (
        f"{100 * mfu:.2f}% ({_si(flops)}FLOP/sample × {samples_per_second:.1f} samples/s, the training loop's mean, "
        f"over {devices} device(s) × {_si(peak)}FLOP/s peak: {profiler.peak_source})"
    )


def _si(value: float) -> str:
    """``50.3 M`` / ``1.2 T``: three significant digits and a decimal prefix."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g} "


def close_monitors(engine: Any) -> None:
    """``engine.destroy()`` on every rank: it writes the monitors' last events (the memory tags of the last step
    arrive there), flushes and closes them, so the report reads complete files."""
    engine.destroy()


def write_run_report(run_dir: Path) -> str:
    """Write ``run_dir/report`` and return the line to print: where it is, or why it could not be written."""
    try:
        from shardspeed.report import write_report

        index = write_report(run_dir)
    except Exception as error:  # matplotlib missing, a bad CSV, a corrupt event file: the run itself succeeded
        return f"report: not written ({type(error).__name__}: {error})"
    shown = run_dir / "report" / index.name  # the path as the user gave it: write_report resolves symlinks
    return f"report: {shown}  (open it in a browser; `shardspeed report {run_dir}` rewrites it)"
