"""The fault table's rows: each fault, how the script injects it, and the job it runs in (pure data)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The process-group timeout every row's job runs with: a rank waiting for a dead peer should fail after this
# (+ the 10 s), not after torch's default 30 minutes. Only effective once initialize reads the field.
COLLECTIVE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Row:
    """One fault: how it is injected (``fault``, read by the script), the job's shape, and what follows."""

    name: str
    title: str
    """The "fault injected" cell."""
    fault: dict[str, Any] | None
    stage: int = 2
    precision: str = "fp32"
    steps: int = 8
    save_every: int = 2
    config: dict[str, Any] = field(default_factory=dict)
    resume: bool = False
    """Relaunch with resume after the fault and compare with the uninterrupted run."""
    damage: str | None = None
    """``corrupt`` / ``truncate``: damage the latest checkpoint of a copy of the baseline's, then the launch
    resumes from it (the fault is the load)."""
    sigterm_launcher: bool = False
    """Send SIGTERM to the launcher once the script writes its marker (the preemption row)."""


def _inject(point: str, rank: int, step: int, inject: str) -> dict[str, Any]:
    return {"point": point, "kind": "inject", "rank": rank, "step": step, "inject": inject}


_NVME = {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "{row}/nvme"}}}

ROWS: tuple[Row, ...] = (
    Row(
        "exc_forward",
        "exception on rank 1 in forward (step 3, ZeRO-2)",
        {"point": "forward", "rank": 1, "step": 3},
        resume=True,
    ),
    Row(
        "exc_backward",
        "exception on rank 1 in backward (step 3, ZeRO-3)",
        {"point": "backward", "rank": 1, "step": 3},
        stage=3,
        resume=True,
    ),
    Row(
        "exc_step",
        "exception on rank 1 in step (step 3, ZeRO-1)",
        {"point": "step", "rank": 1, "step": 3},
        stage=1,
        resume=True,
    ),
    Row(
        "exc_save",
        "exception on rank 1 in save_checkpoint (step 4, ZeRO-2)",
        {"point": "save", "rank": 1, "step": 4},
        resume=True,
    ),
    Row(
        "exc_load",
        "exception on rank 1 in load_checkpoint (step 5, ZeRO-3)",
        {"point": "load", "rank": 1, "step": 5},
        stage=3,
        resume=True,
    ),
    Row("exc_initialize", "exception on rank 1 in initialize (ZeRO-2)", {"point": "initialize", "rank": 1, "step": 0}),
    Row(
        "exc_user",
        "exception on rank 1 in user code between engine calls (step 3, ZeRO-0)",
        {"point": "user", "rank": 1, "step": 3},
        stage=0,
        resume=True,
    ),
    Row(
        "exc_forward_caught",
        "exception on rank 1 in forward, caught by the loop (skip the batch; step 3, ZeRO-2)",
        {"point": "forward", "kind": "caught", "rank": 1, "step": 3},
    ),
    Row(
        "collective_mismatch",
        "collective mismatch: rank 1 alone calls save_checkpoint (step 3, ZeRO-2, verify_collective_order)",
        {"point": "mismatch", "rank": 1, "step": 3},
        config={"fault_tolerance": {"verify_collective_order": True}},
        resume=True,
    ),
    Row(
        "kill_step",
        "kill -9 of rank 1 mid-step (step 5, ZeRO-2)",
        {"point": "step", "kind": "kill", "rank": 1, "step": 5},
        resume=True,
    ),
    Row(
        "kill_backward",
        "kill -9 of rank 1 mid-backward (step 5, ZeRO-3)",
        {"point": "backward", "kind": "kill", "rank": 1, "step": 5},
        stage=3,
        resume=True,
    ),
    Row(
        "kill_save",
        "kill -9 of rank 0 mid-save (step 4, ZeRO-2)",
        {"point": "save", "kind": "kill", "rank": 0, "step": 4},
        resume=True,
    ),
    Row(
        "sigterm_launcher",
        "SIGTERM to the launcher at step 5 (save_on_preemption, no periodic saves; resume: auto_resume)",
        {"point": "preempt", "rank": 0, "step": 5},
        save_every=1000,
        config={"fault_tolerance": {"save_on_preemption": True, "checkpoint_dir": "{row}/ckpt"}},
        resume=True,
        sigterm_launcher=True,
    ),
    Row(
        "enospc_save",
        "ENOSPC on rank 1 in save_checkpoint (step 4, ZeRO-2)",
        _inject("inject", 1, 4, "checkpoint_write:enospc:rank=1"),
        resume=True,
    ),
    Row(
        "enospc_offload_setup",
        "ENOSPC on rank 1 creating the NVMe swap files (initialize, ZeRO-2 offload_optimizer nvme)",
        _inject("inject", 1, 0, "offload_setup:enospc:rank=1"),
        config=_NVME,
    ),
    Row(
        "enospc_offload_write",
        "ENOSPC on rank 1 writing NVMe offload (step 3, ZeRO-2 offload_optimizer nvme)",
        _inject("inject", 1, 3, "offload_write:enospc:rank=1"),
        config=_NVME,
        resume=True,
    ),
    Row(
        "corrupt_byte",
        "one byte flipped in the latest checkpoint (rank 1's file), then resume",
        {"point": "resume_load", "step": 0},
        damage="corrupt",
    ),
    Row(
        "truncated_file",
        "the latest checkpoint's rank 1 file truncated to half, then resume",
        {"point": "resume_load", "step": 0},
        damage="truncate",
    ),
    Row(
        "nan_input",
        "NaN in rank 1's input at step 3 (fp32, gradient_clipping 1.0, ZeRO-2)",
        {"point": "nan", "rank": 1, "step": 3},
    ),
    Row(
        "fp16_storm",
        "fp16 overflow storm: rank 1's loss x 1e30 from step 3 (min_loss_scale 1, patience 3, ZeRO-2)",
        {"point": "fp16_storm", "rank": 1, "step": 3},
        precision="fp16",
        steps=16,
        config={"fault_tolerance": {"min_loss_scale_patience": 3}},
    ),
)
ROWS_BY_NAME = {row.name: row for row in ROWS}


def _fill(value: Any, row_dir: Path) -> Any:
    """``{row}`` in config strings → the row's directory."""
    if isinstance(value, dict):
        return {key: _fill(item, row_dir) for key, item in value.items()}
    if isinstance(value, str):
        return value.replace("{row}", str(row_dir))
    return value


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def make_spec(row: Row, row_dir: Path, *, fault: bool, auto_resume: bool = False) -> dict[str, Any]:
    """The script's spec for one launch of ``row`` (``fault=False``: the baseline or the resume launch)."""
    config = _merge({"fault_tolerance": {"collective_timeout_s": COLLECTIVE_TIMEOUT_S}}, _fill(row.config, row_dir))
    if auto_resume:
        config = _merge(config, {"fault_tolerance": {"auto_resume": True, "checkpoint_dir": str(row_dir / "ckpt")}})
    return {
        "stage": row.stage,
        "precision": row.precision,
        "steps": row.steps,
        "save_every": row.save_every,
        "checkpoint_dir": str(row_dir / "ckpt"),
        "config": config,
        "fault": row.fault if fault else None,
    }


def baseline_key(row: Row) -> str:
    """Runs that must give the same final parameters when nothing goes wrong share one baseline."""
    numerics = {k: v for k, v in row.config.items() if k != "fault_tolerance"}
    return json.dumps([row.stage, row.precision, row.steps, numerics], sort_keys=True)


# ------------------------------------------------------------------------------------------------- damage


def rank_file(tag_dir: Path, rank: int) -> Path:
    """The data file ``rank`` wrote (``rank00001-000.safetensors``), else the first data file."""
    files = sorted(tag_dir.glob("*.safetensors"))
    mine = [path for path in files if re.match(rf"rank0*{rank}-", path.name)]
    if not files:
        raise FileNotFoundError(f"no safetensors file in {tag_dir}")
    return (mine or files)[0]


def corrupt_byte(path: Path) -> str:
    """Flip one byte in the middle of a safetensors file's tensor data (past its JSON header)."""
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    offset = 8 + header + (len(data) - 8 - header) // 2
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    return f"flipped byte {offset} of {path.name}"


def truncate_half(path: Path) -> str:
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)
    return f"truncated {path.name} from {size} to {size // 2} bytes"


DAMAGE: dict[str, Callable[[Path], str]] = {"corrupt": corrupt_byte, "truncate": truncate_half}


def select_rows(names: str | None) -> list[Row]:
    if not names:
        return list(ROWS)
    chosen = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name not in ROWS_BY_NAME:
            raise SystemExit(f"fault_table: unknown row {name!r}; rows: {', '.join(ROWS_BY_NAME)}")
        chosen.append(ROWS_BY_NAME[name])
    return chosen
