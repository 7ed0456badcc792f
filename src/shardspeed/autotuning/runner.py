"""One experiment = one real short launch through shardspeed's launcher; never fatal.

``run_experiment`` writes the trial's config (``<exp_dir>/ds_config.json``, with ``autotuning.enabled`` and the
paths of its metric JSON and progress file), starts ``python -m shardspeed.launcher.cli --num_procs N script
... --deepspeed_config <exp_dir>/ds_config.json`` in its own session, tails ``progress.jsonl`` while it runs (each
new record goes to ``on_progress``; the HPO pruner stops a trial from there) and returns an ``ExperimentResult``:
"ok" with the engine's metric JSON, or "failed" / "timeout" / "pruned" with the reason. Nothing a trial does raises
here — a broken config, a crash, an out-of-memory kill, a hang past ``timeout_s`` are all recorded results.

[Note: stopping a trial] SIGTERM to the launcher reaches every rank (the launcher forwards it, exits 143); if the
job is still there after ``STOP_GRACE_S``, SIGKILL goes to the whole process group (the trial runs in its own
session, so that group is the launcher and its ranks, never the tuner).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "Experiment",
    "ExperimentResult",
    "TrialPruned",
    "read_new_records",
    "run_experiment",
    "trial_config",
    "with_config_arg",
]

Status = Literal["ok", "failed", "timeout", "pruned"]
CONFIG_FILE = "ds_config.json"
METRIC_FILE = "metrics.json"
PROGRESS_FILE = "progress.jsonl"
LOG_FILE = "log.txt"
RESULT_FILE = "result.json"
POLL_S = 0.2
STOP_GRACE_S = 10.0


class TrialPruned(Exception):
    """Raise from ``on_progress`` (or return True from it) to stop the trial now; it is recorded as "pruned"."""


@dataclass
class Experiment:
    name: str
    script: str
    """The training script (or, with ``--module`` in ``launcher_args``, a module name)."""
    script_args: list[str]
    """The script's arguments; ``--deepspeed_config X`` in them is replaced by the trial's config, else appended."""
    ds_config: dict[str, Any]
    """The concrete DeepSpeed config of this trial (its ``autotuning`` section is completed by ``trial_config``)."""
    num_procs: int
    exp_dir: Path
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of the launch (on top of this process's)."""
    launcher_args: list[str] = field(default_factory=list)
    """Extra launcher flags before the script (e.g. ``--module``)."""


@dataclass
class ExperimentResult:
    name: str
    status: Status
    metric: float | None
    """The value of the config's ``autotuning.metric`` (throughput by default) from the metric JSON."""
    metrics: dict[str, Any]
    """The metric JSON the engine wrote (autotuning/probe.py); empty unless "ok"."""
    wall_s: float
    error: str | None
    log_path: Path

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "log_path": str(self.log_path)}


def trial_config(ds_config: dict[str, Any], exp_dir: Path) -> dict[str, Any]:
    """``ds_config`` with its ``autotuning`` section switched on for one trial: metric and progress paths inside
    ``exp_dir``; profile window and metric as the section says (DeepSpeed's defaults otherwise). Pure."""
    config = json.loads(json.dumps(ds_config))  # a deep copy that also proves it is JSON
    section = dict(config.get("autotuning") or {})
    section.update(
        enabled=True,
        metric_path=str(exp_dir / METRIC_FILE),
        progress_path=str(exp_dir / PROGRESS_FILE),
    )
    config["autotuning"] = section
    return config


def with_config_arg(script_args: list[str], config_path: Path) -> list[str]:
    """Point ``--deepspeed_config`` (either spelling: ``--deepspeed_config X`` or ``--deepspeed_config=X``) at
    ``config_path``; append it when absent. Pure."""
    out: list[str] = []
    found = False
    skip = False
    for i, word in enumerate(script_args):
        if skip:
            skip = False
            continue
        if word == "--deepspeed_config":
            out += [word, str(config_path)]
            skip = i + 1 < len(script_args)
            found = True
        elif word.startswith("--deepspeed_config="):
            out.append(f"--deepspeed_config={config_path}")
            found = True
        else:
            out.append(word)
    return out if found else [*out, "--deepspeed_config", str(config_path)]


def read_new_records(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Complete JSON lines of ``path`` after byte ``offset``; returns them and the new offset (a half-written last
    line is left for the next read). Pure I/O, no state."""
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    records = []
    for line in data[:end].splitlines():
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    return records, offset + end


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch_command(exp: Experiment, config_path: Path) -> list[str]:
    """The launch of one trial (also what cmd_optimal.txt records, with the user's config path)."""
    return [
        sys.executable,
        "-m",
        "shardspeed.launcher.cli",
        "--num_procs",
        str(exp.num_procs),
        "--master_port",
        str(_free_port()),
        *exp.launcher_args,
        exp.script,
        *with_config_arg(exp.script_args, config_path),
    ]


def _stop(process: subprocess.Popen[bytes]) -> None:
    """[Note: stopping a trial]."""
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    with contextlib.suppress(ProcessLookupError):  # ranks a dying launcher left behind
        os.killpg(process.pid, signal.SIGKILL)


def _log_tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    first = [line for line in text if "first failure" in line]
    return (first[-1] if first else "\n".join(text[-lines:])).strip()


def run_experiment(
    exp: Experiment, on_progress: Callable[[dict[str, Any]], bool | None] | None = None
) -> ExperimentResult:
    """Run one trial (see the module docstring). Never raises for anything the trial does."""
    exp_dir = Path(exp.exp_dir)
    exp_dir.mkdir(parents=True, exist_ok=True)
    for stale in (METRIC_FILE, PROGRESS_FILE, RESULT_FILE):
        with contextlib.suppress(FileNotFoundError):
            (exp_dir / stale).unlink()
    config_path = exp_dir / CONFIG_FILE
    config = trial_config(exp.ds_config, exp_dir)
    config_path.write_text(json.dumps(config, indent=2))
    metric_name = str(config["autotuning"].get("metric", "throughput"))
    log_path = exp_dir / LOG_FILE
    argv = launch_command(exp, config_path)
    (exp_dir / "cmd.txt").write_text(" ".join(argv) + "\n")
    start = time.perf_counter()
    status: Status | None = None
    error: str | None = None
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **exp.env}, start_new_session=True
        )
        offset = 0
        try:
            while True:
                done = process.poll() is not None
                records, offset = read_new_records(exp_dir / PROGRESS_FILE, offset)
                for record in records:
                    if on_progress is not None and on_progress(record):
                        raise TrialPruned(f"stopped at step {record.get('step')}")
                if done:
                    break
                if exp.timeout_s and time.perf_counter() - start > exp.timeout_s:
                    status, error = "timeout", f"still running after {exp.timeout_s:g} s"
                    break
                time.sleep(POLL_S)
        except TrialPruned as pruned:
            status, error = "pruned", str(pruned) or "pruned"
        except Exception as exc:  # a broken callback must not leave a trial running
            status, error = "failed", f"on_progress raised {type(exc).__name__}: {exc}"
        finally:
            if process.poll() is None:
                _stop(process)
    wall = time.perf_counter() - start
    metrics: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        metrics = json.loads((exp_dir / METRIC_FILE).read_text())
    if status is None:
        if process.returncode == 0 and metrics:
            status = "ok"
        elif process.returncode == 0:
            status, error = "failed", "the script ended before autotuning.end_profile_step (no metric JSON)"
        else:
            status, error = "failed", f"exit status {process.returncode}: {_log_tail(log_path)}"
    value = metrics.get(metric_name) if status == "ok" else None
    if status == "ok" and not isinstance(value, (int, float)):
        status, error = "failed", f"the metric JSON has no {metric_name!r} figure"
        value = None
    result = ExperimentResult(exp.name, status, value, metrics if status == "ok" else {}, wall, error, log_path)
    (exp_dir / RESULT_FILE).write_text(json.dumps(result.to_json(), indent=2))
    return result
