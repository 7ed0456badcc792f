"""DeepSpeedExamples-style scripts (tests/fixtures/examples/, ``import shardspeed as deepspeed`` their only change) at
ZeRO 0-3 on 2 ranks: cifar10 trains to the same losses at every stage; HelloDeepSpeed trains, checkpoints and
resumes to the losses of an uninterrupted run. One real launch through the ``shardspeed`` launcher (slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "fixtures" / "examples"
REPO_SRC = Path(__file__).resolve().parents[2] / "src"


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cifar_config(path: Path, stage: int, bf16: bool = False) -> str:
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 1000,
    }
    path.write_text(json.dumps(config))
    return str(path)


def _run_cifar(rank: int, world: int, config: str) -> dict:
    return _script("cifar10_ds").main(["--deepspeed", "--deepspeed_config", config, "--num-samples", "32"])


@pytest.mark.parametrize("stages", [(0, 3), pytest.param((0, 1, 2), marks=pytest.mark.slow)])
def test_cifar10_example_at_every_zero_stage(dist_run, tmp_path: Path, stages: tuple[int, ...]) -> None:
    losses = {}
    for stage in stages:
        results = dist_run(_run_cifar, 2, _cifar_config(tmp_path / f"ds{stage}.json", stage))
        for result in results:
            assert result["global_steps"] == 4  # 32 samples / (2 per rank × 2 ranks × GAS 2)
            assert result["losses"] == results[0]["losses"]  # the all-reduced mean, through deepspeed.comm
            assert 0.0 <= result["accuracy"] <= 1.0
        losses[stage] = results[0]["losses"]
    for stage in stages[1:]:  # fp32: every stage trains the same model
        assert max(abs(a - b) for a, b in zip(losses[stage], losses[0])) <= 1e-5, stage


@pytest.mark.slow
def test_cifar10_example_in_bf16(dist_run, tmp_path: Path) -> None:
    for stage in (0, 2, 3):
        results = dist_run(_run_cifar, 2, _cifar_config(tmp_path / f"bf{stage}.json", stage, bf16=True))
        assert all(r["global_steps"] == 4 for r in results)


def _hello_resume(rank: int, world: int, root: str, extra: list[str]) -> dict:
    """Uninterrupted run (steps 1-6), then a run stopped after step 3 and resumed from its checkpoint (steps 4-6)."""
    hello = _script("hello_bert_ds")
    whole = hello.main(["--checkpoint_dir", f"{root}/whole", "--num_iterations", "7", *extra])
    first = hello.main(["--checkpoint_dir", f"{root}/split", "--num_iterations", "4", *extra])
    resumed = hello.main(["--load_checkpoint_dir", first["exp_dir"], "--num_iterations", "7", *extra])
    return {"whole": whole, "first": first, "resumed": resumed, "latest": Path(first["exp_dir"], "latest").read_text()}


def _check_resume(results: list[dict], tolerance: float) -> None:
    for r in results:
        whole, first, resumed = r["whole"]["losses"], r["first"]["losses"], r["resumed"]["losses"]
        assert sorted(whole) == [1, 2, 3, 4, 5, 6] and sorted(first) == [1, 2, 3] and sorted(resumed) == [4, 5, 6]
        assert r["resumed"]["start_step"] == 4 and r["latest"].strip() == "global_step6"
        for step in (1, 2, 3):
            assert first[step] == whole[step], step
        for step in (4, 5, 6):
            assert abs(resumed[step] - whole[step]) <= tolerance, (step, resumed[step], whole[step])


@pytest.mark.parametrize(("stage", "extra"), [(1, ["--offload"])])  # the example's own config: stage 1, offload
def test_hello_deepspeed_train_checkpoint_resume(dist_run, tmp_path: Path, stage: int, extra: list[str]) -> None:
    results = dist_run(_hello_resume, 2, str(tmp_path), ["--zero_stage", str(stage), *extra])
    _check_resume(results, 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stage", "extra"),
    [(0, []), (1, []), (2, []), (3, []), (2, ["--offload"]), (3, ["--offload"]), (0, ["--bf16"]), (3, ["--bf16"])],
)
def test_hello_deepspeed_resume_matrix(dist_run, tmp_path: Path, stage: int, extra: list[str]) -> None:
    results = dist_run(_hello_resume, 2, str(tmp_path), ["--zero_stage", str(stage), *extra])
    _check_resume(results, 1e-6)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_cifar10_example_through_the_launcher(tmp_path: Path) -> None:
    """``shardspeed --num_procs 2 cifar10_ds.py --deepspeed --deepspeed_config ds.json``: the script as a user runs it
    (the launcher appends ``--local_rank=N``, which the script's parser takes, as DeepSpeed's)."""
    config = _cifar_config(tmp_path / "ds.json", 2)
    console = Path(sys.executable).parent / "shardspeed"
    launcher = [str(console)] if console.exists() else [sys.executable, "-m", "shardspeed.launcher.cli"]
    command = [
        *launcher,
        "--num_procs",
        "2",
        "--master_port",
        str(_free_port()),
        str(EXAMPLES / "cifar10_ds.py"),
        "--deepspeed",
        "--deepspeed_config",
        config,
        "--num-samples",
        "32",
        "--result-file",
        str(tmp_path / "result"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_SRC), env.get("PYTHONPATH", "")]))
    completed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170)
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = [json.loads((tmp_path / f"result.rank{rank}").read_text()) for rank in range(2)]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["global_steps"] == 4 and r["losses"] == results[0]["losses"] for r in results)
