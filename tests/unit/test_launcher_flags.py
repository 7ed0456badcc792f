"""DeepSpeed's runner flags in the shardspeed launcher: parsed, turned into the exact per-rank command (rank_exec),
or refused with the reason — and rank_exec itself (the per-rank shim torchrun starts) run for real, without torch."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from test_launcher import _plan  # the launcher tests' plan helper

from shardspeed.launcher import cli
from shardspeed.launcher.deepspeed_flags import RANK_EXEC_SCRIPT, rank_options
from shardspeed.launcher.errors import LauncherError
from shardspeed.launcher.rank_exec import (
    RankExecError,
    build_command,
    cores_for_rank,
    parse,
    parse_core_list,
)

PY = sys.executable

# Every flag of DeepSpeed's runner (deepspeed/launcher/runner.py, 0.19): value flags with a sample value.
DEEPSPEED_VALUE_FLAGS = {
    "--hostfile": "hf",
    "--include": "localhost:0",
    "--exclude": "localhost:1",
    "--num_nodes": "1",
    "--min_elastic_nodes": "1",
    "--max_elastic_nodes": "2",
    "--num_gpus": "1",
    "--num_accelerators": "1",
    "--master_port": "29501",
    "--master_addr": "10.0.0.1",
    "--node_rank": "0",
    "--launcher": "pdsh",
    "--launcher_args": "-o X=y",
    "--enable_each_rank_log": "logs",
    "--autotuning": "tune",
    "--comment": "c",
    "--account": "a",
    "--bind_core_list": "0-3",
    "--ssh_port": "2222",
    "--venv_script": "/venv/bin/activate",
}
DEEPSPEED_FLAGS = [
    "--module",
    "--no_python",
    "--no_local_rank",
    "--no_ssh",
    "--no_ssh_check",
    "--force_multi",
    "--save_pid",
    "--elastic_training",
    "--bind_cores_to_rank",
]


@pytest.mark.parametrize("flag", [*DEEPSPEED_VALUE_FLAGS, *DEEPSPEED_FLAGS])
def test_every_deepspeed_runner_flag_is_recognized(flag: str) -> None:
    words = [flag, DEEPSPEED_VALUE_FLAGS[flag]] if flag in DEEPSPEED_VALUE_FLAGS else [flag]
    options = cli.parse_launch_args([*words, "train.py", "--lr", "1"])  # argparse exits on an unknown flag
    assert options.script == "train.py"
    assert options.script_args == ["--lr", "1"]


def test_num_accelerators_is_num_gpus() -> None:
    assert cli.parse_launch_args(["--num_accelerators", "3", "t.py"]).num_gpus == 3


def _rank_words(argv: list[str]) -> list[str]:
    """The words after rank_exec.py in a torchrun command."""
    return argv[argv.index(RANK_EXEC_SCRIPT) + 1 :]


def test_default_command_runs_the_script_through_rank_exec(in_tmp: Path) -> None:
    [command] = _plan(["--num_procs", "2", "train.py", "--x", "1"]).commands
    assert command.argv[:2] == [PY, str(Path(cli.__file__).with_name("torchrun_agent.py"))]
    assert _rank_words(command.argv) == ["--script", "train.py", "--x", "1"]


def test_per_rank_flags_reach_rank_exec(in_tmp: Path) -> None:
    argv = ["--num_procs", "2", "--no_local_rank", "--bind_cores_to_rank", "--bind_core_list", "0-3,8"]
    [command] = _plan([*argv, "train.py"]).commands
    assert _rank_words(command.argv) == [
        "--no_local_rank",
        "--bind_cores_to_rank",
        "--bind_core_list",
        "0-3,8",
        "--script",
        "train.py",
    ]


def test_module_and_no_python_do_not_need_a_file(in_tmp: Path) -> None:
    [command] = _plan(["--module", "package.train", "--epochs", "2"]).commands
    assert _rank_words(command.argv) == ["--module", "--script", "package.train", "--epochs", "2"]
    [command] = _plan(["--no_python", "run.sh"]).commands
    assert _rank_words(command.argv) == ["--no_python", "--script", "run.sh"]
    with pytest.raises(LauncherError, match="cannot be used together"):
        _plan(["--module", "--no_python", "x"])


def test_each_rank_log_dir_is_absolute_with_one_timestamp_prefix(in_tmp: Path) -> None:
    options = cli.parse_launch_args(["--enable_each_rank_log", "logs", "train.py"])
    rank = rank_options(options, now=0.0)
    assert rank.each_rank_log == str(in_tmp / "logs")
    assert len(rank.log_prefix) == 14 and rank.log_prefix.isdigit()  # %Y%m%d%H%M%S
    assert rank.words() == ["--each_rank_log", str(in_tmp / "logs"), "--log_prefix", rank.log_prefix]
    assert rank_options(cli.parse_launch_args(["--enable_each_rank_log", "None", "t.py"])).each_rank_log is None


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--elastic_training"], "elastic training is not implemented yet"),
        (["--min_elastic_nodes", "1"], "elastic training is not implemented yet"),
        (["--max_elastic_nodes", "4"], "elastic training is not implemented yet"),
        (["--comment", "x"], "SLURM launcher"),
        (["--account", "x"], "SLURM launcher"),
        (["--launcher", "slurm"], "--launcher slurm: not implemented"),
        (["--launcher", "OpenMPI"], "--launcher openmpi: not implemented"),
        (["--no_ssh"], "--no_ssh starts this node only and needs --node_rank"),
        (["--bind_core_list", "0-3"], "--bind_core_list needs --bind_cores_to_rank"),
        (["--bind_cores_to_rank", "--bind_core_list", "3-1"], "runs backwards"),
        (["--bind_cores_to_rank", "--bind_core_list", "0,x"], "'x' is not a core number"),
    ],
)
def test_refused_flags_name_the_reason(in_tmp: Path, argv: list[str], reason: str) -> None:
    with pytest.raises(LauncherError, match=reason):
        _plan([*argv, "train.py"])


def test_refusal_is_reported_by_the_cli_before_anything_starts(
    in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--elastic_training", "train.py"]) == 2
    assert "elastic training is not implemented yet" in capsys.readouterr().err


def test_autotuning_without_a_config_is_a_clear_error(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--autotuning", "tune", "train.py"]) == 2
    assert "--autotuning needs the script's --deepspeed_config FILE" in capsys.readouterr().err
    assert cli.main(["--autotuning", "fast", "train.py", "--deepspeed_config", "c.json"]) == 2
    assert "expected tune or run" in capsys.readouterr().err


def test_no_ssh_with_node_rank_starts_this_node(in_tmp: Path) -> None:
    [command] = _plan(["--no_ssh", "--num_nodes", "2", "--node_rank", "1", "--num_procs", "2", "train.py"]).commands
    assert command.argv[2:5] == ["--nnodes=2", "--node_rank=1", "--nproc_per_node=2"]


def _hostfile(directory: Path) -> str:
    (directory / "hostfile").write_text("a slots=1\nb slots=1\n")
    return str(directory / "hostfile")


def test_ssh_port_launcher_args_and_venv_script_over_ssh(in_tmp: Path) -> None:
    argv = ["-H", _hostfile(in_tmp), "--launcher", "ssh", "--ssh_port", "2222"]
    argv += ["--launcher_args", "-o 'StrictHostKeyChecking no'", "--venv_script", "/opt/my env/activate"]
    plan = _plan([*argv, "train.py"], which=lambda name: f"/usr/bin/{name}")
    for command, host in zip(plan.commands, ["a", "b"]):
        assert command.argv[:8] == ["ssh", "-o", "BatchMode=yes", "-p", "2222", "-o", "StrictHostKeyChecking no", host]
        words = shlex.split(command.argv[8])
        assert words[:7] == ["cd", str(in_tmp), "&&", ".", "/opt/my env/activate", "&&", "exec"]
        assert _rank_words(words) == ["--script", "train.py"]


def test_ssh_port_and_launcher_args_over_pdsh(in_tmp: Path) -> None:
    argv = ["-H", _hostfile(in_tmp), "--launcher", "pdsh", "--ssh_port", "2200", "--launcher_args", "-f 8"]
    plan = _plan([*argv, "train.py"], which=lambda name: f"/usr/bin/{name}")
    assert plan.commands[0].argv[:8] == ["pdsh", "-S", "-R", "ssh", "-f", "8", "-w", "a"]
    assert plan.commands[0].env_overrides == {"PDSH_SSH_ARGS_APPEND": "-p 2200"}


def test_remote_only_flags_are_noted_for_a_local_launch(in_tmp: Path) -> None:
    plan = _plan(["--ssh_port", "2222", "--launcher_args", "-q", "train.py"])
    assert sum("ignored for this local launch" in note for note in plan.notes) == 2


def test_save_pid_file_lives_while_the_launch_runs(tmp_path: Path) -> None:
    with cli.pid_file(4242, str(tmp_path)) as path:
        assert path == str(tmp_path / "4242.deepspeed")
        assert Path(path).read_text() == "4242"
        with pytest.raises(LauncherError, match="already exists"), cli.pid_file(4242, str(tmp_path)):
            pass
    assert not Path(path).exists()


# ---------------------------------------------------------------------------------------------- rank_exec


def test_rank_exec_builds_deepspeeds_per_rank_command() -> None:
    environ = {"LOCAL_RANK": "3"}
    options, command = parse(["--script", "train.py", "--lr", "1"])
    assert build_command(options, command, environ) == [PY, "-u", "train.py", "--local_rank=3", "--lr", "1"]
    options, command = parse(["--module", "--script", "pkg.train", "--lr", "1"])
    assert build_command(options, command, environ) == [PY, "-u", "-m", "pkg.train", "--local_rank=3", "--lr", "1"]
    options, command = parse(["--no_python", "--no_local_rank", "--script", "./run.sh", "x"])
    assert build_command(options, command, environ) == ["./run.sh", "x"]
    options, command = parse(["--script", "-odd.py"])  # python would read "-odd.py" as an option
    assert build_command(options, command, environ)[2] == "./-odd.py"
    for bad in (
        ["train.py"],
        ["--script"],
        ["--bogus", "--script", "t.py"],
        ["--module", "--no_python", "--script", "t"],
    ):
        with pytest.raises(RankExecError):
            parse(bad)


def test_core_lists_and_per_rank_slices() -> None:
    assert parse_core_list("0,2-4,7") == [0, 2, 3, 4, 7]
    for bad in ("1,1", "-1", "4-2", "a", "1-", ""):
        with pytest.raises(RankExecError):
            parse_core_list(bad)
    cores = list(range(10))
    assert [cores_for_rank(cores, rank, 3) for rank in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(RankExecError, match="each rank needs one"):
        cores_for_rank([0, 1], 0, 3)


PROBE = "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'omp': os.environ.get('OMP_NUM_THREADS'), "
PROBE += "'cores': sorted(os.sched_getaffinity(0)), 'pid': os.getpid()}))"


def test_rank_exec_runs_the_script_with_local_rank_log_and_binding(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two usable cores")
    env = {**os.environ, "LOCAL_RANK": "1", "RANK": "5", "LOCAL_WORLD_SIZE": "2"}
    core_list = f"{allowed[0]},{allowed[1]}"  # local rank 1 of 2 gets the second
    argv = [PY, RANK_EXEC_SCRIPT, "--bind_cores_to_rank", "--bind_core_list", core_list]
    argv += ["--each_rank_log", str(tmp_path / "logs"), "--log_prefix", "P", "--script", "probe.py", "a b"]
    completed = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout == ""  # everything went to the rank's log file
    result = json.loads((tmp_path / "logs" / "P_rank5.log").read_text())
    assert result["argv"] == ["--local_rank=1", "a b"]
    assert result["cores"] == [allowed[1]]
    assert result["omp"] == "1"


def test_rank_exec_reports_bad_options_and_missing_programs(tmp_path: Path) -> None:
    bad = subprocess.run([PY, RANK_EXEC_SCRIPT, "t.py"], capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "missing '--script'" in bad.stderr
    missing = subprocess.run(
        [PY, RANK_EXEC_SCRIPT, "--no_python", "--script", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert missing.returncode == 127 and "cannot run" in missing.stderr
