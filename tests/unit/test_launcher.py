"""The shardspeed launcher without launching torch: hostfile parsing, resource selection, the exact commands
built for single- and multi-node jobs, the subcommand dispatch rule, and process supervision."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardspeed.launcher import cli
from shardspeed.launcher.errors import LauncherError
from shardspeed.launcher.hostfile import parse_hostfile_text, read_hostfile, validate_hostname
from shardspeed.launcher.multinode import choose_launcher, exported_env, remote_shell_command
from shardspeed.launcher.plan import plan_launch
from shardspeed.launcher.processes import LaunchCommand, exit_code_of, run_commands
from shardspeed.launcher.resources import parse_host_filter, pool_from_slot_counts, select_resources
from shardspeed.launcher.subcommands import (
    get_subcommand,
    register_subcommand,
    subcommands,
    unregister_subcommand,
)

PY = sys.executable
REMOTE_NODE = str(Path(cli.__file__).resolve().parent / "remote_node.py")
RANK_EXEC = str(Path(cli.__file__).resolve().parent / "rank_exec.py")
AGENT = str(Path(cli.__file__).resolve().parent / "torchrun_agent.py")


# ---------------------------------------------------------------------------------------------- hostfile


def test_hostfile_parses_hosts_in_order_with_comments_and_blanks() -> None:
    text = """
# cluster A
worker-2 slots=4
worker-1   slots=8   # trailing comment

10.0.0.7 slots=1
[fe80::1] slots=2
node_3.example.com slots=16
"""
    parsed = parse_hostfile_text(text, "hf")
    assert list(parsed.items()) == [
        ("worker-2", 4),
        ("worker-1", 8),
        ("10.0.0.7", 1),
        ("[fe80::1]", 2),
        ("node_3.example.com", 16),
    ]


@pytest.mark.parametrize(
    ("line", "line_number"),
    [
        ("worker-1", 2),
        ("worker-1 slots=", 2),
        ("worker-1 slots=x", 2),
        ("worker-1 slots=-1", 2),
        ("worker-1 slots=2 extra", 2),
        ("worker-1 gpus=2", 2),
        ("slots=2", 2),
        ("worker-1 slots = 2", 2),
    ],
)
def test_hostfile_bad_line_names_file_line_and_text(line: str, line_number: int) -> None:
    with pytest.raises(LauncherError) as error:
        parse_hostfile_text(f"ok slots=1\n{line}\n", "my/hostfile")
    message = str(error.value)
    assert f"my/hostfile:{line_number}" in message
    assert line in message


def test_hostfile_zero_slots_is_an_error() -> None:
    with pytest.raises(LauncherError, match=r"hf:1.*slots=0"):
        parse_hostfile_text("a slots=0\n", "hf")


def test_hostfile_duplicate_host_names_both_lines() -> None:
    with pytest.raises(LauncherError) as error:
        parse_hostfile_text("a slots=1\nb slots=1\n\na slots=2\n", "hf")
    assert "hf:4" in str(error.value)
    assert "line 1" in str(error.value)
    assert "'a'" in str(error.value)


def test_hostfile_without_hosts_is_an_error() -> None:
    with pytest.raises(LauncherError, match="no hosts"):
        parse_hostfile_text("# only a comment\n\n", "hf")


@pytest.mark.parametrize(
    "line",
    [
        "host;rm -rf / slots=1",
        "host;rm slots=1",
        "$(reboot) slots=1",
        "a`id` slots=1",
        "a|b slots=1",
        "a&&b slots=1",
        "-oProxyCommand=touch_x slots=1",
        "user@host slots=1",
        "a'b slots=1",
        "[fe80::1;x] slots=1",
    ],
)
def test_hostfile_rejects_shell_and_option_injection(line: str) -> None:
    with pytest.raises(LauncherError, match="hf:1"):
        parse_hostfile_text(line + "\n", "hf")


def test_validate_hostname_accepts_safe_names() -> None:
    for name in ["localhost", "127.0.0.1", "::1", "[::1]", "gpu-01.cluster_a", "[fe80::1%eth0]"]:
        assert validate_hostname(name, "test") == name


def test_read_hostfile_missing_file_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(LauncherError, match=r"--hostfile.*nope"):
        read_hostfile(missing)


# ---------------------------------------------------------------------------------------------- resources

POOL = pool_from_slot_counts({"worker-0": 4, "worker-1": 4, "worker-2": 2})


def test_pool_from_slot_counts() -> None:
    assert POOL == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}


def test_parse_host_filter_syntax() -> None:
    assert parse_host_filter("a@b:0,2@[fe80::1]:1@[::2]", "--include") == {
        "a": None,
        "b": [0, 2],
        "[fe80::1]": [1],
        "[::2]": None,
    }
    # A host named twice: slot lists merge; a bare mention means the whole host.
    assert parse_host_filter("a:2@a:0", "--include") == {"a": [0, 2]}
    assert parse_host_filter("a:2@a", "--include") == {"a": None}


@pytest.mark.parametrize("spec", ["", "a:x", "a:1,,2", "a:-1", "[fe80::1", "[::1]x", "a;b", "$(x):0"])
def test_parse_host_filter_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(LauncherError, match="--exclude"):
        parse_host_filter(spec, "--exclude")


def test_include_keeps_named_hosts_and_slots_in_pool_order() -> None:
    # Spec order is irrelevant: node ranks follow the hostfile.
    assert select_resources(POOL, include="worker-2:1@worker-0") == {
        "worker-0": [0, 1, 2, 3],
        "worker-2": [1],
    }


def test_exclude_removes_slots_and_whole_hosts() -> None:
    assert select_resources(POOL, exclude="worker-1:0,3@worker-2") == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [1, 2],
    }
    # Excluding every slot of a host drops the host.
    assert select_resources(POOL, exclude="worker-2:0,1") == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [0, 1, 2, 3],
    }


def test_filters_reject_unknown_hosts_and_slots() -> None:
    with pytest.raises(LauncherError, match=r"'worker-9'.*did you mean \"worker-"):
        select_resources(POOL, include="worker-9")
    with pytest.raises(LauncherError, match=r"'worker-2' has no slot\(s\) \[5\]"):
        select_resources(POOL, exclude="worker-2:0,5")


def test_filter_combinations_are_errors() -> None:
    with pytest.raises(LauncherError, match="--include and --exclude"):
        select_resources(POOL, include="worker-0", exclude="worker-1")
    with pytest.raises(LauncherError, match="cannot be combined"):
        select_resources(POOL, include="worker-0", num_nodes=1)
    with pytest.raises(LauncherError, match="cannot be combined"):
        select_resources(POOL, exclude="worker-0", procs_per_node=1)
    with pytest.raises(LauncherError, match="no hosts"):
        select_resources(POOL, exclude="worker-0@worker-1@worker-2")


def test_num_nodes_and_procs_per_node() -> None:
    assert select_resources(POOL, num_nodes=2, procs_per_node=3) == {
        "worker-0": [0, 1, 2],
        "worker-1": [0, 1, 2],
    }
    with pytest.raises(LauncherError, match="--num_nodes 4"):
        select_resources(POOL, num_nodes=4)
    with pytest.raises(LauncherError, match="'worker-2' has only 2"):
        select_resources(POOL, procs_per_node=3)


# ---------------------------------------------------------------------------------------------- commands


def _plan(argv: list[str], **kwargs: object):  # -> LaunchPlan
    kwargs.setdefault("environ", {})
    kwargs.setdefault("device_count", lambda: 0)
    kwargs.setdefault("default_hostfile", "/nonexistent/hostfile")
    return plan_launch(cli.parse_launch_args(argv), **kwargs)  # type: ignore[arg-type]


def test_single_node_cpu_command(in_tmp: Path) -> None:
    plan = _plan(["--num_procs", "3", "--master_port", "1234", "train.py", "--foo", "bar baz", "--num_procs", "9"])
    [command] = plan.commands
    assert command.argv == [
        PY,
        AGENT,  # torchrun, plus failure records for ranks killed by a signal
        "--nnodes=1",
        "--node_rank=0",
        "--nproc_per_node=3",
        "--master_addr=127.0.0.1",
        "--master_port=1234",
        "--max_restarts=0",
        RANK_EXEC,  # each rank: python -u train.py --local_rank=N ..., as DeepSpeed's launcher runs it
        "--script",
        "train.py",
        "--foo",
        "bar baz",
        "--num_procs",
        "9",
    ]
    assert command.env_overrides == {}


def test_single_node_defaults(in_tmp: Path) -> None:
    plan = _plan(["train.py"])  # no CUDA: one process, with a note saying so
    assert "--nproc_per_node=1" in plan.commands[0].argv
    assert "--master_port=29500" in plan.commands[0].argv
    assert any("--num_procs" in note for note in plan.notes)
    plan = _plan(["train.py"], device_count=lambda: 4)  # CUDA: one process per device
    assert "--nproc_per_node=4" in plan.commands[0].argv
    assert plan.notes == []


def test_num_gpus_against_devices(in_tmp: Path) -> None:
    assert "--nproc_per_node=2" in _plan(["--num_gpus", "2", "train.py"], device_count=lambda: 4).commands[0].argv
    with pytest.raises(LauncherError, match="'localhost' has only 4"):
        _plan(["--num_gpus", "8", "train.py"], device_count=lambda: 4)
    # --num_procs never consults devices; --num_gpus on a CPU machine means processes.
    assert "--nproc_per_node=8" in _plan(["--num_procs", "8", "train.py"], device_count=lambda: 4).commands[0].argv
    assert "--nproc_per_node=5" in _plan(["--num_gpus", "5", "train.py"]).commands[0].argv


def test_num_gpus_and_num_procs_together_is_an_error(in_tmp: Path) -> None:
    with pytest.raises(LauncherError, match="only one"):
        _plan(["--num_gpus", "1", "--num_procs", "1", "train.py"])


def test_local_include_sets_visible_devices(in_tmp: Path) -> None:
    plan = _plan(["--include", "localhost:1,3", "train.py"], device_count=lambda: 4)
    assert "--nproc_per_node=2" in plan.commands[0].argv
    assert plan.commands[0].env_overrides == {"CUDA_VISIBLE_DEVICES": "1,3"}
    plan = _plan(
        ["--exclude", "localhost:0", "train.py"],
        device_count=lambda: 3,
        environ={"CUDA_VISIBLE_DEVICES": "0,1,2"},
    )
    assert plan.commands[0].env_overrides == {"CUDA_VISIBLE_DEVICES": "1,2"}
    assert any("override CUDA_VISIBLE_DEVICES" in note for note in plan.notes)


def test_missing_script_is_an_error(in_tmp: Path) -> None:
    with pytest.raises(LauncherError, match=r"'nope\.py' not found"):
        _plan(["nope.py"])


def _write_hostfile(directory: Path, text: str) -> str:
    path = directory / "hostfile"
    path.write_text(text)
    return str(path)


def test_single_host_hostfile_runs_locally(in_tmp: Path) -> None:
    hostfile = _write_hostfile(in_tmp, "gpu-box slots=2\n")
    plan = _plan(["--hostfile", hostfile, "train.py"])
    assert plan.commands[0].argv[:2] == [PY, AGENT]
    assert "--nproc_per_node=2" in plan.commands[0].argv


def test_default_hostfile_used_only_when_present(in_tmp: Path) -> None:
    hostfile = _write_hostfile(in_tmp, "a slots=1\nb slots=1\n")
    plan = _plan(["train.py"], default_hostfile=hostfile, which=lambda name: f"/usr/bin/{name}")
    assert [command.name for command in plan.commands] == ["node 0 (a)", "node 1 (b)"]
    assert len(_plan(["train.py"], default_hostfile=str(in_tmp / "absent")).commands) == 1


def _ssh_only(name: str) -> str | None:
    return "/usr/bin/ssh" if name == "ssh" else None


def test_multi_node_ssh_commands_are_quoted_argv(in_tmp: Path) -> None:
    hostfile = _write_hostfile(in_tmp, "node-a slots=2\n[fe80::2] slots=1\n")
    environ = {"PYTHONPATH": "/src dir", "NCCL_DEBUG": "INFO", "HOME": "/root", "SECRET_TOKEN": "x"}
    hostile = ["--name", "x; touch /tmp/pwned", "$(id)", "`id`", "a'b", 'q"q', "*", "new\nline"]
    plan = _plan(
        ["--hostfile", hostfile, "--master_port", "4321", "train.py", *hostile],
        environ=environ,
        which=_ssh_only,
    )
    assert plan.resources == {"node-a": [0, 1], "[fe80::2]": [0]}
    for node_rank, (command, host, address, nproc) in enumerate(
        zip(plan.commands, ["node-a", "[fe80::2]"], ["node-a", "fe80::2"], [2, 1])
    ):
        assert command.name == f"node {node_rank} ({host})"
        assert command.hold_stdin
        assert command.argv[:4] == ["ssh", "-o", "BatchMode=yes", address]
        assert len(command.argv) == 5
        # shlex.split follows POSIX shell word splitting: what the remote shell will see, word for word.
        assert shlex.split(command.argv[4]) == [
            "cd",
            str(in_tmp),
            "&&",
            "exec",
            "env",
            "NCCL_DEBUG=INFO",
            "PYTHONPATH=/src dir",
            PY,
            "-u",
            REMOTE_NODE,
            "--nnodes=2",
            f"--node_rank={node_rank}",
            f"--nproc_per_node={nproc}",
            "--master_addr=node-a",
            "--master_port=4321",
            "--max_restarts=0",
            RANK_EXEC,
            "--script",
            "train.py",
            *hostile,
        ]


def test_multi_node_filter_passes_devices_per_node(in_tmp: Path) -> None:
    hostfile = _write_hostfile(in_tmp, "a slots=4\nb slots=4\nc slots=4\n")
    plan = _plan(["--hostfile", hostfile, "--include", "c:3@a:1,2", "train.py"], which=_ssh_only)
    remote_words = [shlex.split(command.argv[-1]) for command in plan.commands]
    assert [command.argv[3] for command in plan.commands] == ["a", "c"]
    assert "CUDA_VISIBLE_DEVICES=1,2" in remote_words[0]
    assert "--nproc_per_node=2" in remote_words[0]
    assert "CUDA_VISIBLE_DEVICES=3" in remote_words[1]
    assert "--nproc_per_node=1" in remote_words[1]
    assert "--master_addr=a" in remote_words[1]


def test_multi_node_num_nodes_and_master_override(in_tmp: Path) -> None:
    hostfile = _write_hostfile(in_tmp, "a slots=4\nb slots=4\nc slots=4\n")
    plan = _plan(
        ["-H", hostfile, "--num_nodes", "2", "--num_gpus", "3", "--master_addr", "10.1.1.1", "train.py"],
        which=_ssh_only,
    )
    remote_words = [shlex.split(command.argv[-1]) for command in plan.commands]
    assert len(remote_words) == 2
    assert all("--nproc_per_node=3" in words and "--master_addr=10.1.1.1" in words for words in remote_words)
    assert not any(word.startswith("CUDA_VISIBLE_DEVICES") for words in remote_words for word in words)


def test_pdsh_launcher_commands(in_tmp: Path) -> None:
    hostfile = _write_hostfile(in_tmp, "a slots=1\nb slots=2\n")
    plan = _plan(["-H", hostfile, "train.py", "--x"], which=lambda name: f"/usr/bin/{name}")  # auto → pdsh
    assert [command.argv[:6] for command in plan.commands] == [
        ["pdsh", "-S", "-R", "ssh", "-w", "a"],
        ["pdsh", "-S", "-R", "ssh", "-w", "b"],
    ]
    words = shlex.split(plan.commands[1].argv[6])
    assert words[5:8] == [PY, "-u", AGENT]
    assert words[-5:] == ["--max_restarts=0", RANK_EXEC, "--script", "train.py", "--x"]
    forced_ssh = _plan(["-H", hostfile, "--launcher", "ssh", "train.py"], which=lambda name: f"/usr/bin/{name}")
    assert forced_ssh.commands[0].argv[0] == "ssh"


def test_choose_launcher() -> None:
    assert choose_launcher("auto", _ssh_only) == "ssh"
    assert choose_launcher("auto", lambda name: f"/bin/{name}") == "pdsh"
    with pytest.raises(LauncherError, match="'pdsh' was not found"):
        choose_launcher("pdsh", _ssh_only)


def test_force_multi_uses_ssh_for_one_host(in_tmp: Path) -> None:
    plan = _plan(["--force_multi", "--launcher", "ssh", "--num_procs", "2", "train.py"], which=_ssh_only)
    assert plan.commands[0].argv[:4] == ["ssh", "-o", "BatchMode=yes", "localhost"]
    assert "--master_addr=localhost" in shlex.split(plan.commands[0].argv[4])


def test_manual_node_rank_mode(in_tmp: Path) -> None:
    hostfile = _write_hostfile(in_tmp, "a slots=2\nb slots=3\n")
    [command] = _plan(["-H", hostfile, "--node_rank", "1", "train.py"]).commands
    assert command.argv[2:8] == [
        "--nnodes=2",
        "--node_rank=1",
        "--nproc_per_node=3",
        "--master_addr=a",
        "--master_port=29500",
        "--max_restarts=0",
    ]
    [command] = _plan(["--num_nodes", "4", "--node_rank", "3", "--num_procs", "2", "train.py"]).commands
    assert command.argv[2:5] == ["--nnodes=4", "--node_rank=3", "--nproc_per_node=2"]
    with pytest.raises(LauncherError, match="--node_rank 2"):
        _plan(["-H", hostfile, "--node_rank", "2", "train.py"])
    with pytest.raises(LauncherError, match="--num_nodes 2 needs a --hostfile"):
        _plan(["--num_nodes", "2", "train.py"])


def test_bad_numbers(in_tmp: Path) -> None:
    with pytest.raises(LauncherError, match="--master_port 70000"):
        _plan(["--master_port", "70000", "train.py"])
    with pytest.raises(LauncherError, match="--num_procs 0"):
        _plan(["--num_procs", "0", "train.py"])


def test_exported_env_and_remote_shell_command() -> None:
    environ = {
        "PYTHONPATH": "p",
        "OMP_NUM_THREADS": "1",
        "NCCL_IB_DISABLE": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "TORCH_DISTRIBUTED_DEBUG": "INFO",
        "HOME": "/root",
        "AWS_SECRET_ACCESS_KEY": "k",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    assert exported_env(environ) == {
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_IB_DISABLE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": "p",
        "TORCH_DISTRIBUTED_DEBUG": "INFO",
    }
    assert remote_shell_command("/a b", {"K": "v w"}, ["prog", "x;y"]) == "cd '/a b' && exec env 'K=v w' prog 'x;y'"


# ---------------------------------------------------------------------------------------------- dispatch


def test_split_script_args() -> None:
    split = cli.split_script_args
    assert split(["--num_procs", "2", "train.py", "--num_procs", "3"]) == (
        ["--num_procs", "2"],
        "train.py",
        ["--num_procs", "3"],
    )
    assert split(["--master_port=1", "-Hhf", "--dry_run", "t.py"]) == (
        ["--master_port=1", "-Hhf", "--dry_run"],
        "t.py",
        [],
    )
    assert split(["-H", "hf", "--", "--odd.py", "a"]) == (["-H", "hf"], "--odd.py", ["a"])
    assert split(["--num_procs", "2"]) == (["--num_procs", "2"], None, [])
    assert split(["--"]) == ([], None, [])
    assert split([]) == ([], None, [])


def test_every_value_option_is_known_to_the_splitter() -> None:
    # The splitter must skip the value of every launcher option that takes one, or it would take the value
    # for the script. Cross-check the splitter's table against what argparse actually parses.
    parser = cli.build_parser()
    for action in parser._actions:
        if action.option_strings and action.nargs != 0:
            for flag in action.option_strings:
                assert cli.split_script_args([flag, "v", "s.py"])[1] == "s.py", flag


@pytest.fixture
def probe() -> Iterator[list[list[str]]]:
    calls: list[list[str]] = []

    def record(argv: list[str]) -> int:
        calls.append(argv)
        return 7

    register_subcommand("unit-probe", record, "test probe")
    yield calls
    unregister_subcommand("unit-probe")


def test_first_word_subcommand_dispatches(probe: list[list[str]]) -> None:
    assert cli.main(["unit-probe", "--num_procs", "2", "x.py"]) == 7
    assert probe == [["--num_procs", "2", "x.py"]]


def test_subcommand_name_not_first_is_a_script(
    probe: list[list[str]], in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (in_tmp / "unit-probe").write_text("")
    assert cli.main(["--dry_run", "./unit-probe", "arg"]) == 0
    assert cli.main(["--dry_run", "--", "unit-probe", "arg"]) == 0
    assert cli.main(["--dry_run", "--num_procs", "1", "unit-probe", "arg"]) == 0
    assert probe == []
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("./unit-probe arg")
    assert out[1].endswith("rank_exec.py --script unit-probe arg")
    assert "--nproc_per_node=1 --master_addr=127.0.0.1 --master_port=29500 --max_restarts=0 " in out[2]
    assert out[2].endswith("rank_exec.py --script unit-probe arg")


def test_help_subcommand(probe: list[list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["help"]) == 0
    text = capsys.readouterr().out
    assert "first word is a subcommand name" in text
    assert "unit-probe" in text and "test probe" in text
    assert cli.main(["help", "unit-probe"]) == 7
    assert probe == [["--help"]]
    assert cli.main(["help", "unit-prob"]) == 2
    assert 'did you mean "unit-probe"' in capsys.readouterr().err


def test_main_errors_return_codes(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "missing the training script" in capsys.readouterr().err
    assert cli.main(["--num_gpus", "1", "--num_procs", "1", "train.py"]) == 2
    assert "--num_gpus and --num_procs" in capsys.readouterr().err
    assert cli.main(["--hostfile", "absent", "train.py"]) == 2
    assert cli.main(["--bogus", "train.py"]) == 2
    assert cli.main(["--help"]) == 0


def test_typo_of_subcommand_gets_a_suggestion(
    probe: list[list[str]], in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["unit-prob"]) == 2
    assert 'did you mean "unit-probe"' in capsys.readouterr().err


def test_subcommand_registry_rules() -> None:
    for bad_name in ["train.py", "a/b", "Estimate", "-x", "a--b", "", "zero_to_fp32"]:
        with pytest.raises(LauncherError, match="invalid"):
            register_subcommand(bad_name, lambda argv: 0)
    with pytest.raises(LauncherError, match="already registered"):
        register_subcommand("help", lambda argv: 0)
    with pytest.raises(LauncherError, match="module:function"):
        register_subcommand("unit-lazy", "not an import path")
    register_subcommand("unit-lazy", "shardspeed.launcher.cli:help_command")
    try:
        assert get_subcommand("unit-lazy").resolve() is cli.help_command  # type: ignore[union-attr]
        assert "unit-lazy" in [command.name for command in subcommands()]
    finally:
        unregister_subcommand("unit-lazy")
    assert get_subcommand("unit-lazy") is None


# ---------------------------------------------------------------------------------------------- processes


def _python(code: str, name: str = "p", hold_stdin: bool = False) -> LaunchCommand:
    return LaunchCommand(name=name, argv=[PY, "-c", code], hold_stdin=hold_stdin)


def test_run_commands_success_and_signal_exit_codes() -> None:
    assert run_commands([_python("pass"), _python("import time; time.sleep(0.3)")]) == 0
    assert run_commands([_python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")]) == 137
    assert exit_code_of(-15) == 143
    assert exit_code_of(4) == 4


def test_first_failure_stops_the_others(tmp_path: Path) -> None:
    marker = tmp_path / "survived"
    start = time.monotonic()
    code = run_commands(
        [
            _python(f"import time; time.sleep(20); open({str(marker)!r}, 'w')", "sleeper"),
            # Reads its held-open stdin until EOF: must end when the launcher gives up on the job.
            _python("import sys; sys.stdin.read(); sys.exit(0)", "stdin-reader", hold_stdin=True),
            _python("import time, sys; time.sleep(0.3); sys.exit(3)", "failer"),
        ],
        grace_s=5.0,
    )
    assert code == 3
    assert time.monotonic() - start < 10
    time.sleep(0.1)
    assert not marker.exists()


def test_held_stdin_is_a_pipe_until_the_end() -> None:
    code = run_commands(
        [
            _python(
                "import os, stat, sys; sys.exit(0 if stat.S_ISFIFO(os.fstat(0).st_mode) else 9)",
                hold_stdin=True,
            )
        ]
    )
    assert code == 0


def test_sigterm_to_launcher_stops_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    child_code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    # processes.py needs only the standard library: load it by path so this child skips the package's imports.
    processes_path = Path(cli.__file__).with_name("processes.py")
    launcher_code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('processes', {str(processes_path)!r})\n"
        "processes = importlib.util.module_from_spec(spec)\n"
        "sys.modules['processes'] = processes\n"
        "spec.loader.exec_module(processes)\n"
        "command = processes.LaunchCommand(name='c', argv=[sys.executable, '-c', sys.argv[1]])\n"
        "sys.exit(processes.run_commands([command]))\n"
    )
    launcher = subprocess.Popen([PY, "-c", launcher_code, child_code])
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child_pid = int(pid_file.read_text())
    launcher.terminate()
    assert launcher.wait(timeout=30) == 143
    with pytest.raises(ProcessLookupError):  # reaped by the launcher, so no zombie either
        os.kill(child_pid, 0)


def test_cli_module_runs_as_script(in_tmp: Path) -> None:
    src = Path(cli.__file__).parents[2]
    result = subprocess.run(
        [PY, "-m", "shardspeed.launcher.cli", "--dry_run", "--num_procs", "2", "train.py", "--a"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(
        f"--nproc_per_node=2 --master_addr=127.0.0.1 --master_port=29500 --max_restarts=0 "
        f"{RANK_EXEC} --script train.py --a"
    )
