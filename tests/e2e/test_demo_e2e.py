"""``python -m shardspeed.demo`` end to end: self-relaunch under torch.distributed.run, two gloo workers,
training through ``shardspeed.initialize``, and the summary a user reads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def run_demo(*arguments: str, timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # the test is about the CPU/gloo path on any machine
    return subprocess.run(
        [sys.executable, "-m", "shardspeed.demo", *arguments],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


@pytest.mark.timeout(300)
def test_the_tiny_demo_trains_on_two_ranks_and_the_loss_goes_down(tmp_path: Path) -> None:
    result = run_demo("--nproc", "2", "--steps", "20", "--tiny", "--run-dir", str(tmp_path / "run"), timeout=280)
    report = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    assert result.returncode == 0, report
    assert re.search(r"world size\s+2 \(gloo, cpu\)", result.stdout), report
    train = re.search(r"train loss\s+([\d.]+) -> ([\d.]+)", result.stdout)
    evaluation = re.search(r"eval loss\s+([\d.]+) -> ([\d.]+)", result.stdout)
    assert train and evaluation, report
    first, last = float(train.group(1)), float(train.group(2))
    assert last < first - 0.3, report  # 20 steps take a byte model well below uniform (ln 256 ≈ 5.55)
    assert float(evaluation.group(2)) < float(evaluation.group(1)), report
    assert re.search(r"steps\s+20\b", result.stdout), report
    assert re.search(r"peak RSS per rank\s+\d+/\d+ MB", result.stdout), report
    assert re.search(r"loss went down\s+yes", result.stdout), report


@pytest.mark.timeout(120)
def test_an_invalid_stage_is_one_clean_line_not_a_traceback(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"  # never the default runs/demo-<time> in pytest's cwd: rank 0 writes ds_config.json
    arguments = ("--nproc", "2", "--steps", "2", "--tiny", "--stage", "7", "--run-dir", str(run_dir))
    result = run_demo(*arguments, timeout=110, cwd=tmp_path)
    report = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    assert result.returncode == 2, report
    assert "shardspeed.demo: config error:" in result.stderr, report
    assert "stage" in result.stderr, report
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, report
    assert not (tmp_path / "runs").exists(), report


def _png_has_data(path: Path) -> bool:
    import matplotlib.image

    pixels = matplotlib.image.imread(str(path))
    return path.read_bytes()[:4] == b"\x89PNG" and bool((pixels != pixels[0, 0]).any())


@pytest.mark.timeout(300)
def test_the_demo_writes_its_run_directory_and_ends_with_the_report(tmp_path: Path) -> None:
    """ds_config.json as given to initialize, the monitors' logs and the flops profile where this build
    has those sections ([Note: sections the config may not know yet] in demo/observe.py), the MFU row, the report."""
    from shardspeed.demo.observe import known_sections

    run = tmp_path / "run"
    known = known_sections()
    small = ("--tiny", "--eval-windows", "32", "--corpus-mb", "1")
    result = run_demo("--nproc", "2", "--steps", "6", *small, "--run-dir", str(run), timeout=280)
    report = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    assert result.returncode == 0, report
    config = json.loads((run / "ds_config.json").read_text())
    assert config["train_micro_batch_size_per_gpu"] == 8, report
    index = run / "report" / "index.html"
    assert f"report: {index}" in result.stdout, report
    page = index.read_text()
    assert "&quot;train_micro_batch_size_per_gpu&quot;: 8" in page
    if "csv_monitor" in known:
        assert config["csv_monitor"]["enabled"] and list((run / "csv" / "demo").glob("*.csv")), report
        from shardspeed.report.scalars import read_csv_scalars, read_tensorboard_scalars

        events = read_tensorboard_scalars(run / "tensorboard" / "demo")  # tensorboard's own reader
        tag, csv_loss = read_csv_scalars(run / "csv" / "demo" / "Train_Samples_train_loss.csv")
        assert tag == "Train/Samples/train_loss" and len(csv_loss) == 6, report  # one point per optimizer step
        assert [x for x, _ in events[tag]] == [x for x, _ in csv_loss] == [16 * (i + 1) for i in range(6)]
        assert [v for _, v in events[tag]] == pytest.approx([v for _, v in csv_loss], rel=1e-6)  # float32 in TB
        for name in ("loss", "lr", "throughput", "memory"):
            assert _png_has_data(run / "report" / f"{name}.png"), name
            assert f'src="{name}.png"' in page
    else:  # this build refuses the monitor sections: the page says what is missing instead
        assert "csv_monitor" not in config and "Train/Samples/train_loss" in page
    if "flops_profiler" in known:
        assert (run / "flops_profile.txt").read_text().strip(), report
        assert re.search(r"MFU\s+\d+\.\d+% \(", result.stdout), report
    else:
        assert re.search(r"MFU\s+n/a", result.stdout), report


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_with_wandb_writes_an_offline_run_into_its_run_directory(tmp_path: Path) -> None:
    """``--wandb``: WANDB_MODE=offline and WANDB_DIR=the run directory unless the environment chose (slow: W&B's
    service start-up takes several seconds)."""
    from shardspeed.demo.observe import known_sections

    if "wandb" not in known_sections():
        pytest.skip("this build has no wandb config section")
    run = tmp_path / "run"
    small = ("--tiny", "--eval-windows", "32", "--corpus-mb", "1")
    result = run_demo("--nproc", "2", "--steps", "4", *small, "--wandb", "--run-dir", str(run), timeout=280)
    report = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    assert result.returncode == 0, report
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb")), report
    assert json.loads((run / "ds_config.json").read_text())["wandb"]["enabled"], report
