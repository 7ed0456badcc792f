"""``make gpu-check``'s driver (benchmarks/gpu_check.py) on CPU: the skip path, the table, timeouts, failures,
``--json``. The checks themselves need a GPU; here they are stand-in subprocesses."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_check
from gpu_check import Check, Host, Result

CPU_HOST = Host("2.13.0+cpu", cuda_available=False, gpus=0)
ONE_GPU = Host("2.13.0+cu128", cuda_available=True, gpus=1, nccl_available=True, gpu_names=("NVIDIA H200",))
TWO_GPUS = Host("2.13.0+cu128", cuda_available=True, gpus=2, nccl_available=True, gpu_names=("A", "B"))


def _never() -> bool:
    raise AssertionError("the bench's flags must not be probed for a check that is skipped anyway")


def _plain(name: str, code: str, timeout_s: float = 60.0) -> Check:
    return Check(name, (sys.executable, "-c", code), timeout_s, kind="plain")


def test_cpu_host_skips_every_check_with_its_reason_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    status = gpu_check.main([], host=CPU_HOST, bench_has_device=_never)
    out = capsys.readouterr().out
    assert status == 0
    names = [c.name for c in gpu_check.plan_checks()]
    assert names == ["cuda-world1", "gloo-cuda", "nccl", "bench-cuda", "bench-compression-cuda"]
    for name in names:  # one clear line per skipped check, then the same reason in the table
        assert f"{name}: skipped: torch.cuda.is_available() is False (torch 2.13.0+cpu)\n" in out
    assert out.rstrip().endswith("total 0.0 s; exit status 0")


def test_skip_reasons_for_one_gpu_no_nccl_and_no_bench_flag() -> None:
    nccl, bench, _ = gpu_check.plan_checks()[2:]
    assert gpu_check.skip_reason(nccl, ONE_GPU, bench_has_device=_never) == (
        "1 CUDA device(s); NCCL needs one GPU per rank, so its multi-rank tests need ≥ 2"
    )
    no_nccl = Host("2.13.0", cuda_available=True, gpus=2, nccl_available=False)
    assert "is_nccl_available() is False" in gpu_check.skip_reason(nccl, no_nccl, bench_has_device=_never)
    assert gpu_check.skip_reason(nccl, TWO_GPUS, bench_has_device=_never) == ""
    assert gpu_check.skip_reason(bench, ONE_GPU, bench_has_device=lambda: False) == (
        "bench_engine has no --device (helper E's flag is not on this branch)"
    )
    assert gpu_check.skip_reason(bench, ONE_GPU, bench_has_device=lambda: True) == ""
    failed_probe = gpu_check.probe_host(python=sys.executable + "-missing")
    assert failed_probe.probe_error.startswith("probing torch failed: ") and not failed_probe.cuda_available
    failed_probe = Host("unknown", False, 0, probe_error="probing torch failed: boom")
    assert gpu_check.skip_reason(bench, failed_probe, bench_has_device=_never) == "probing torch failed: boom"


def test_plan_runs_the_multi_rank_files_apart_and_quick_is_shorter() -> None:
    world1, gloo, nccl, bench, compression = gpu_check.plan_checks("py")
    assert "--ignore=tests/cuda/test_gloo_cuda.py" in world1.argv and "--ignore=tests/cuda/test_nccl.py" in world1.argv
    assert all(path in world1.argv for path in gpu_check.EXISTING_CUDA_TESTS)
    assert gloo.argv[-1] == "tests/cuda/test_gloo_cuda.py" and nccl.argv[-1] == "tests/cuda/test_nccl.py"
    assert bench.argv == ("py", "benchmarks/bench_engine.py", "--device", "cuda", "--rounds", "3")
    assert compression.argv[:4] == ("py", "benchmarks/bench_compression_speed.py", "--device", "cuda")
    assert compression.argv[-2:] == ("--rounds", "5") and compression.requires == ("cuda",)
    quick = gpu_check.plan_checks("py", quick=True)
    assert quick[4].argv[-4:] == ("--rounds", "1", "--steps", "2")
    assert "cuda and not slow" in quick[0].argv and "-x" in quick[0].argv
    assert quick[3].argv[-6:] == ("--rounds", "1", "--steps", "3", "--warmup", "1")
    assert gpu_check.DEFAULT_BUDGET_S <= 8 * 60 - 10  # the 8 minutes, whatever each check's own timeout


def test_table_format() -> None:
    results = [
        Result("cuda-world1", "passed", "12 passed, 1 skipped", 41.25),
        Result("nccl", "skipped", "", 0.0, "1 CUDA device(s); NCCL needs ≥ 2"),
        Result("bench-cuda", "timeout", "no result within 5 s (killed)", 5.01),
    ]
    assert gpu_check.format_table(results, ONE_GPU) == "\n".join(
        [
            "gpu-check: torch 2.13.0+cu128; NVIDIA H200",
            "check        result   figures                           seconds",
            "-----------  -------  --------------------------------  -------",
            "cuda-world1  passed   12 passed, 1 skipped                 41.2",
            "nccl         skipped  1 CUDA device(s); NCCL needs ≥ 2      0.0",
            "bench-cuda   timeout  no result within 5 s (killed)         5.0",
            "total 46.3 s; exit status 1",
        ]
    )


def test_pytest_output_is_judged_by_its_summary_line() -> None:
    check = Check("t", ("pytest",), 10)
    output = "....s\nSKIPPED [1] tests/cuda/x.py:3: gloo: no reduce_scatter\n4 passed, 1 skipped in 2.0s\n"
    passed = gpu_check.judge(check, 0, output, 2)
    assert (passed.result, passed.figures) == ("passed", "4 passed, 1 skipped")
    assert passed.notes == ["tests/cuda/x.py:3: gloo: no reduce_scatter"]
    skipped = gpu_check.judge(check, 0, "SKIPPED [3] tests/cuda/x.py:9: needs CUDA\n3 skipped in 0.1s\n", 1)
    assert (skipped.result, skipped.reason) == ("skipped", "tests/cuda/x.py:9: needs CUDA")
    failed = gpu_check.judge(check, 1, "FAILED tests/cuda/x.py::t - boom\n1 failed, 2 passed, 1 error in 3.0s\n", 3)
    assert (failed.result, failed.figures) == ("failed", "1 failed, 2 passed, 1 errors")
    empty = gpu_check.judge(check, 5, "no tests ran in 0.01s\n", 0.1)
    assert (empty.result, empty.reason) == ("skipped", "no tests collected")


def test_a_check_past_its_timeout_is_reported_as_such_and_its_children_killed() -> None:
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('child', child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    [result] = gpu_check.run_checks([_plain("hangs", code, timeout_s=3.0)], ONE_GPU, echo=lambda _: None)
    assert time.monotonic() - start < 30
    assert (result.result, result.figures) == ("timeout", "no result within 3 s (killed)")
    assert gpu_check.exit_status([result]) == 1
    pid = int(result.output_tail.split()[1])
    for _ in range(50):  # the orphan is reaped by init shortly after the kill
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the check's child {pid} survived the timeout")


def test_a_failing_check_makes_the_exit_status_nonzero_and_json_records_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest_like = "print('SKIPPED [1] tests/cuda/t.py:3: gloo refuses x'); print('2 passed, 1 skipped in 1.0s')"
    checks = [
        Check("ok", (sys.executable, "-c", pytest_like), 60.0),
        _plain("bad", "import sys; print('broken'); sys.exit(3)"),
    ]
    out_file = tmp_path / "gpu.json"
    status = gpu_check.main(["--json", str(out_file)], checks=checks, host=ONE_GPU, bench_has_device=_never)
    assert status == 1
    printed = capsys.readouterr().out
    assert "--- bad: failed; last lines of its output ---\nbroken" in printed
    assert "--- ok: skipped tests ---\ntests/cuda/t.py:3: gloo refuses x" in printed  # reasons inside a passed check
    payload = json.loads(out_file.read_text())
    assert payload["exit_status"] == 1
    assert payload["host"]["gpu_names"] == ["NVIDIA H200"]
    assert [(r["name"], r["result"], r["returncode"]) for r in payload["results"]] == [
        ("ok", "passed", 0),
        ("bad", "failed", 3),
    ]
    assert [r["figures"] for r in payload["results"]] == [
        "2 passed, 1 skipped",
        "exit status 3",
    ]


def test_the_budget_cuts_a_check_short_and_skips_the_rest() -> None:
    checks = [_plain("long", "import time; time.sleep(60)", timeout_s=60.0), _plain("next", "pass")]
    first, second = gpu_check.run_checks(checks, ONE_GPU, budget_s=2.0, min_start_s=1.0, echo=lambda _: None)
    assert first.result == "timeout" and first.seconds < 10
    assert (second.result, second.reason) == ("skipped", "the 2 s budget is spent")


def test_probe_on_this_host_reads_torch_from_a_subprocess() -> None:
    import torch

    host = gpu_check.probe_host()
    assert host.torch_version == torch.__version__ and host.probe_error == ""
    if not torch.cuda.is_available():
        assert (host.cuda_available, host.gpus, host.gpu_names) == (False, 0, ())


@pytest.mark.slow  # three pytest / python processes: about 15 s on a quiet machine
def test_the_real_checks_run_their_commands(tmp_path: Path) -> None:
    """The real plan against a host that claims one GPU: the pytest commands collect the CUDA tests (paths, marker,
    ignores right) — which then skip here, with the reason, as torch sees no CUDA — and the bench check is asked
    for its flag. Guards the commands that otherwise only ever run on a GPU host."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: `make gpu-check` runs the checks for real")
    results = gpu_check.run_checks(gpu_check.plan_checks(quick=True), ONE_GPU, echo=lambda _: None)
    world1, gloo, nccl, bench, compression = results
    for r in (world1, gloo):
        assert r.result == "skipped" and "torch.cuda.is_available() is False" in r.reason, r
    assert "skipped" in world1.figures and int(world1.figures.split()[0]) >= 29  # tests/cuda + the unit ones
    assert nccl.reason.startswith("1 CUDA device(s)")
    assert bench.result == "skipped" if bench.reason else bench.result in ("passed", "failed", "timeout")
    # the compression bench runs (the host claims a GPU) and refuses at once, naming why
    assert compression.result == "failed" and "torch.cuda.is_available() is False" in compression.output_tail


def test_the_cpu_suite_hides_cuda_unless_asked() -> None:
    """tests/conftest.py: without SHARDSPEED_TEST_CUDA=1 the suite never sees a GPU, so on a GPU host forked gloo
    ranks stay on the CPU (the engine would put them on cuda:LOCAL_RANK, where a forked child cannot start CUDA);
    gpu_check opts its pytest runs in."""
    import torch

    if os.environ.get("SHARDSPEED_TEST_CUDA") == "1":
        pytest.skip("this run asked for CUDA (SHARDSPEED_TEST_CUDA=1)")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()
    assert gpu_check._env()["SHARDSPEED_TEST_CUDA"] == "1"
