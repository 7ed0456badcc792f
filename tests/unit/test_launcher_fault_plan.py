"""The launcher's reliability pieces without launching: ``--max_restarts`` and the c10d rendezvous in the exact
torchrun commands, ``SHARDSPEED_FAILURE_DIR`` in every node's environment, the first-failure report, torchrun's
failed ranks turned into records, and the remote side's own failure directory."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_launcher import _plan  # the launcher tests' plan helper

from shardspeed.launcher import cli
from shardspeed.launcher.errors import LauncherError
from shardspeed.launcher.failure_report import (
    AGENT_WHERE,
    FAILURE_DIR_ENV,
    RankFailure,
    failure_dir,
    read_failures,
    report_lines,
    write_failure,
)
from shardspeed.launcher.torchrun_agent import record_child_failures

PY = sys.executable
LAUNCHER_DIR = Path(cli.__file__).resolve().parent
AGENT = str(LAUNCHER_DIR / "torchrun_agent.py")


def _ssh_only(name: str) -> str | None:
    return "/usr/bin/ssh" if name == "ssh" else None


def _torchrun_words(argv: list[str]) -> list[str]:
    """torchrun's own arguments: between the agent script and rank_exec.py."""
    start = argv.index(AGENT) + 1
    end = next(index for index, word in enumerate(argv) if word.endswith("/rank_exec.py"))
    return argv[start:end]


# ---------------------------------------------------------------------------------------------- restarts


def test_max_restarts_reaches_torchrun(in_tmp: Path) -> None:
    [command] = _plan(["--num_procs", "2", "--max_restarts", "3", "train.py"]).commands
    assert "--max_restarts=3" in _torchrun_words(command.argv)
    [command] = _plan(["--num_procs", "2", "--max-restarts=1", "train.py"]).commands  # torchrun's spelling
    assert "--max_restarts=1" in _torchrun_words(command.argv)
    [command] = _plan(["train.py"]).commands
    assert "--max_restarts=0" in _torchrun_words(command.argv)  # default: a failed rank fails the job
    with pytest.raises(LauncherError, match="--max_restarts -1: must be >= 0"):
        _plan(["--max_restarts", "-1", "train.py"])


def test_max_restarts_reaches_every_node_and_warns_under_static_multinode(in_tmp: Path) -> None:
    (in_tmp / "hf").write_text("a slots=1\nb slots=1\n")
    plan = _plan(["-H", "hf", "--launcher", "ssh", "--max_restarts", "2", "train.py"], which=_ssh_only)
    for command in plan.commands:
        assert "--max_restarts=2" in shlex.split(command.argv[-1])
    assert any("--rdzv_backend c10d to restart every node together" in note for note in plan.notes)
    plan = _plan(
        ["-H", "hf", "--launcher", "ssh", "--max_restarts", "2", "--rdzv_backend", "c10d", "train.py"],
        which=_ssh_only,
    )
    assert plan.notes == []


# ---------------------------------------------------------------------------------------------- rendezvous


def test_c10d_nodes_started_by_hand(in_tmp: Path) -> None:
    argv = ["--nnodes", "2", "--num_procs", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "10.0.0.1:4000"]
    [command] = _plan([*argv, "--rdzv_id", "job7", "train.py"]).commands
    assert _torchrun_words(command.argv) == [
        "--nnodes=2",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=10.0.0.1:4000",
        "--rdzv_id=job7",
        "--max_restarts=0",
    ]  # no --node_rank: the c10d rendezvous numbers the nodes in arrival order
    [command] = _plan(["--num_nodes", "3", "--rdzv_backend", "c10d", "--master_port", "4100", "train.py"]).commands
    words = _torchrun_words(command.argv)
    assert "--rdzv_endpoint=127.0.0.1:4100" in words and "--rdzv_id=shardspeed" in words
    assert "--nnodes=3" in words


def test_c10d_over_ssh_uses_the_first_host_as_endpoint(in_tmp: Path) -> None:
    (in_tmp / "hf").write_text("a slots=1\nb slots=2\n")
    plan = _plan(["-H", "hf", "--launcher", "ssh", "--rdzv_backend", "c10d", "train.py"], which=_ssh_only)
    for command, nproc in zip(plan.commands, (1, 2)):
        words = shlex.split(command.argv[-1])
        assert f"--nproc_per_node={nproc}" in words
        assert "--rdzv_endpoint=a:29500" in words
        assert not any(word.startswith(("--node_rank", "--master_addr")) for word in words)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rdzv_endpoint", "h:1"], "--rdzv_endpoint needs --rdzv_backend c10d"),
        (["--rdzv_id", "x"], "--rdzv_id needs --rdzv_backend c10d"),
        (["--rdzv_backend", "c10d", "--rdzv_endpoint", "host"], "--rdzv_endpoint 'host': expected HOST:PORT"),
        (["--rdzv_backend", "c10d", "--rdzv_endpoint", "h:99999"], "expected HOST:PORT"),
        (["--rdzv_backend", "c10d", "--rdzv_id", "a b"], "--rdzv_id 'a b'"),
        (["--num_nodes", "2"], "--num_nodes 2 needs a --hostfile"),
    ],
)
def test_bad_rendezvous_options(in_tmp: Path, argv: list[str], message: str) -> None:
    with pytest.raises(LauncherError, match=message):
        _plan([*argv, "train.py"])


def test_rendezvous_flags_are_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--max_restarts", "--rdzv_backend", "--rdzv_endpoint", "--rdzv_id", "--nnodes"):
        assert flag in text


# ---------------------------------------------------------------------------------------------- failure dir


def test_failure_dir_reaches_every_node(in_tmp: Path) -> None:
    [command] = _plan(["--num_procs", "2", "train.py"], failure_dir="/tmp/fd").commands
    assert command.env_overrides == {FAILURE_DIR_ENV: "/tmp/fd"}
    (in_tmp / "hf").write_text("a slots=1\nb slots=1\n")
    plan = _plan(["-H", "hf", "--launcher", "ssh", "train.py"], which=_ssh_only, failure_dir="/tmp/fd")
    for command in plan.commands:
        assert f"{FAILURE_DIR_ENV}=/tmp/fd" in shlex.split(command.argv[-1])


def test_failure_dir_is_fresh_and_removed() -> None:
    with failure_dir() as first, failure_dir() as second:
        assert first != second and os.listdir(first) == []
        Path(first, "rank0.json").write_text("{}")
    assert not os.path.exists(first) and not os.path.exists(second)


def test_report_names_the_earliest_record(tmp_path: Path) -> None:
    write_failure(str(tmp_path), RankFailure(rank=0, time=20.0, where="engine.backward()", error="PeerFailedError: x"))
    write_failure(str(tmp_path), RankFailure(rank=3, time=10.5, where="engine.step() at step 3", error="E: boom"))
    (tmp_path / "rank1.json").write_text('{"rank": 1, "ti')  # a rank killed while writing
    assert report_lines(str(tmp_path)) == [
        "[shardspeed] first failure: rank 3 in engine.step() at step 3: E: boom",
        "[shardspeed] later failure records: rank 0",
        "[shardspeed] unreadable failure records: rank1.json",
    ]


def test_a_ranks_own_record_outranks_the_agents_earlier_one(tmp_path: Path) -> None:
    """torchrun's whole-second time for rank 0 (which exited *because* rank 1 failed) is earlier than rank 1's own
    record; the cause is still rank 1's."""
    write_failure(str(tmp_path), RankFailure(rank=0, time=100.0, where=AGENT_WHERE, error="exited with code 1"))
    write_failure(str(tmp_path), RankFailure(rank=1, time=100.7, where="engine.step() at step 3", error="E: boom"))
    assert report_lines(str(tmp_path))[0] == "[shardspeed] first failure: rank 1 in engine.step() at step 3: E: boom"


def test_report_without_records_says_so(tmp_path: Path) -> None:
    assert report_lines(str(tmp_path), where="this node") == [
        "[shardspeed] no rank on this node wrote a failure record (see the ranks' output above)"
    ]
    assert read_failures(str(tmp_path / "missing")) == ([], [])


def test_torchrun_failures_become_records_without_replacing_a_ranks_own(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    missing = str(tmp_path / "no-error-file")
    failures = {
        1: ProcessFailure(local_rank=1, pid=11, exitcode=-signal.SIGKILL, error_file=missing),
        0: ProcessFailure(local_rank=0, pid=10, exitcode=-signal.SIGTERM, error_file=missing),  # torchrun's teardown
        2: ProcessFailure(local_rank=0, pid=12, exitcode=3, error_file=missing),
    }
    own = RankFailure(rank=2, time=1.0, where="engine.step()", error="RuntimeError: mine")
    write_failure(str(tmp_path), own)
    record_child_failures(str(tmp_path), ChildFailedError("rank_exec.py", failures))
    records = {failure.rank: failure for failure in read_failures(str(tmp_path))[0]}
    assert set(records) == {1, 2}
    assert records[1].where == "process" and records[1].error == "killed by SIGKILL (exit code -9)"
    assert records[2] == own
    # Every failure a SIGTERM (the job was stopped from outside): they are all recorded.
    stopped = {0: ProcessFailure(local_rank=0, pid=10, exitcode=-signal.SIGTERM, error_file=missing)}
    record_child_failures(str(tmp_path), ChildFailedError("rank_exec.py", stopped))
    assert json.loads((tmp_path / "rank0.json").read_text())["error"] == "killed by SIGTERM (exit code -15)"


def test_remote_node_creates_reports_and_removes_its_own_failure_dir(tmp_path: Path) -> None:
    """A real remote node does not have the launcher's directory: remote_node.py makes it for its ranks, prints
    the node's first failure and removes it. A fake torchrun_agent.py beside it stands in for torchrun."""
    directory = tmp_path / "launcher-side-path"
    fake_agent = tmp_path / "torchrun_agent.py"
    fake_agent.write_text(
        "import json, os, sys\n"
        f"path = os.path.join(os.environ[{FAILURE_DIR_ENV!r}], 'rank5.json')\n"
        "json.dump({'rank': 5, 'time': 1.0, 'where': 'engine.step()', 'error': 'ValueError: bad'}, open(path, 'w'))\n"
        "sys.exit(1)\n"
    )
    for name in ("remote_node.py", "failure_report.py"):
        (tmp_path / name).write_text((LAUNCHER_DIR / name).read_text())
    completed = subprocess.run(
        [PY, str(tmp_path / "remote_node.py")],
        env={**os.environ, FAILURE_DIR_ENV: str(directory)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 1
    assert "[shardspeed] first failure: rank 5 in engine.step(): ValueError: bad" in completed.stderr
    assert not directory.exists()


def test_script_arguments_that_prefix_a_torchrun_option_reach_the_script() -> None:
    from shardspeed.launcher.torchrun_agent import torchrun_parser

    args = torchrun_parser().parse_args(["--nproc_per_node=2", "train.py", "--run", "x", "--nnode", "3"])
    assert args.training_script == "train.py"
    assert args.training_script_args == ["--run", "x", "--nnode", "3"]
