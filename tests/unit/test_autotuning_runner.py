"""The experiment runner's pure parts (autotuning/runner.py): the trial's config, the script's config argument, and
reading the progress file while it grows."""

from __future__ import annotations

import json
from pathlib import Path

from shardspeed.autotuning.runner import read_new_records, trial_config, with_config_arg


def test_trial_config_switches_autotuning_on_with_paths_in_the_trial_dir(tmp_path: Path) -> None:
    user = {"train_micro_batch_size_per_gpu": 2, "autotuning": {"end_profile_step": 7, "enabled": False}}
    config = trial_config(user, tmp_path)
    assert config["autotuning"] == {
        "end_profile_step": 7,
        "enabled": True,
        "metric_path": str(tmp_path / "metrics.json"),
        "progress_path": str(tmp_path / "progress.jsonl"),
    }
    assert user["autotuning"]["enabled"] is False  # a copy


def test_config_argument_is_replaced_in_either_spelling_or_appended() -> None:
    cfg = Path("/x/ds_config.json")
    assert with_config_arg(["--deepspeed_config", "a.json", "--lr", "1"], cfg) == [
        "--deepspeed_config",
        str(cfg),
        "--lr",
        "1",
    ]
    assert with_config_arg(["--deepspeed_config=a.json"], cfg) == [f"--deepspeed_config={cfg}"]
    assert with_config_arg(["--lr", "1"], cfg) == ["--lr", "1", "--deepspeed_config", str(cfg)]


def test_progress_is_read_line_by_line_leaving_a_half_written_line(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    assert read_new_records(path, 0) == ([], 0)  # not there yet
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "lo')
    records, offset = read_new_records(path, 0)
    assert records == [{"step": 1}]
    with path.open("a") as out:
        out.write('ss": 3.5}\n')
    records, offset = read_new_records(path, offset)
    assert records == [{"step": 2, "loss": 3.5}] and offset == path.stat().st_size


def test_the_final_launch_drops_the_autotuners_own_flags() -> None:
    from shardspeed.autotuning.command import config_path_of, strip_autotuning_flags

    words = ["--autotuning", "run", "--num_procs", "2", "--device_memory_gb=0.5", "--host_memory_gb", "8"]
    assert strip_autotuning_flags(words) == ["--num_procs", "2"]
    assert config_path_of(["--x", "--deepspeed_config", "c.json"]) == "c.json"
    assert config_path_of(["--deepspeed_config=d.json"]) == "d.json" and config_path_of(["--x"]) is None
