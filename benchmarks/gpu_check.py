"""``make gpu-check``: the CUDA path of the test suite and the benchmark rows on CUDA, in one command.

    python benchmarks/gpu_check.py [--quick] [--json OUT] [--budget-s 470]

Five checks, each a subprocess with its own timeout, all inside one overall budget (default 470 s, so the whole
command stays under 8 minutes on one GPU):

1. ``cuda-world1``   ``pytest -m cuda`` over ``tests/cuda/`` and the existing CUDA-only unit tests: engines on CUDA
                     at stages 0-3 (fp32, bf16) against a CPU reference, offload with pinned memory and side streams,
                     activation checkpointing's CUDA RNG, the fp16 loss scaler.
2. ``gloo-cuda``     ``tests/cuda/test_gloo_cuda.py``: 2 gloo ranks sharing ``cuda:0`` (gloo carries CUDA tensors for
                     the ops it implements; the file probes each op the engine uses and skips what gloo refuses).
3. ``nccl``          ``tests/cuda/test_nccl.py``: one rank per GPU under NCCL (ZeRO 0-3 parity, TP=2, PP=2); only
                     with ≥ 2 GPUs (NCCL refuses two ranks on one GPU).
4. ``bench-cuda``    ``benchmarks/bench_engine.py --device cuda --rounds 3``.
5. ``bench-compression-cuda``  ``benchmarks/bench_compression_speed.py --device cuda --micro-batch 1``: 1-bit Adam
                     against Adam on a SIMULATED 1 and 10 Gbit/s link with the element-wise work on the GPU
                     (issue 18's 10 Gbit/s row, which one CPU thread per rank cannot show).

Then one summary table: check, result, figures, seconds. On a CPU-only machine every check is skipped with its
reason (``skipped: torch.cuda.is_available() is False (torch 2.13.0+cpu)``) and the exit status is 0; a failed or
timed-out check makes it 1.

[Note: why each check is its own process] The multi-rank tests start their ranks with the ``spawn`` method, so a
CUDA context in the parent would not break them; but a process that initialized CUDA cannot ``fork`` ranks that
use CUDA, NCCL reserves memory per process, and a hung collective must not take the other checks with it. A
subprocess per check with a timeout keeps one check's failure (or hang) from hiding the others'. The driver itself
never initializes CUDA: the host is probed in a subprocess too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BUDGET_S = 470.0  # the 8 minutes, less the probe and the table
TAIL_CHARS = 4000  # output kept per check (printed for failures, stored in --json)

# The unit tests that need CUDA and predate tests/cuda (marked ``cuda`` too).
EXISTING_CUDA_TESTS = (
    "tests/unit/test_checkpointing_storage.py",
    "tests/unit/test_checkpointing_rng.py",
    "tests/unit/test_data.py",
)
GLOO_CUDA_TESTS = "tests/cuda/test_gloo_cuda.py"
NCCL_TESTS = "tests/cuda/test_nccl.py"


@dataclass(frozen=True)
class Host:
    """What the probe subprocess found (the driver never touches CUDA itself)."""

    torch_version: str
    cuda_available: bool
    gpus: int
    nccl_available: bool = False
    gpu_names: tuple[str, ...] = ()
    probe_error: str = ""


@dataclass(frozen=True)
class Check:
    """One subprocess: ``argv`` run from the repository root, killed after ``timeout_s``. ``requires`` names what
    the host must have (``cuda``, ``multi_gpu``, ``bench_device``); ``kind`` says how its output is read."""

    name: str
    argv: tuple[str, ...]
    timeout_s: float
    requires: tuple[str, ...] = ()
    kind: str = "pytest"  # "pytest" | "bench" | "plain"


@dataclass
class Result:
    name: str
    result: str  # "passed" | "failed" | "timeout" | "skipped"
    figures: str = ""
    seconds: float = 0.0
    reason: str = ""
    returncode: int | None = None
    output_tail: str = ""
    notes: list[str] = field(default_factory=list)


# --- the host ---------------------------------------------------------------------------------------------------
_PROBE = """
import json, torch, torch.distributed as dist
ok = torch.cuda.is_available()
n = torch.cuda.device_count() if ok else 0
print(json.dumps({"torch_version": torch.__version__, "cuda_available": ok, "gpus": n,
                  "nccl_available": bool(dist.is_available() and dist.is_nccl_available()),
                  "gpu_names": [torch.cuda.get_device_name(i) for i in range(n)]}))
"""


def probe_host(python: str = sys.executable, timeout_s: float = 120.0) -> Host:
    """torch's version and CUDA devices, asked of a fresh interpreter."""
    try:
        done = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s, cwd=REPO_ROOT, env=_env()
        )
    except (subprocess.TimeoutExpired, OSError) as error:
        return Host("unknown", False, 0, probe_error=f"probing torch failed: {error}")
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
        return Host(
            torch_version=found["torch_version"],
            cuda_available=bool(found["cuda_available"]),
            gpus=int(found["gpus"]),
            nccl_available=bool(found["nccl_available"]),
            gpu_names=tuple(found["gpu_names"]),
        )
    except (ValueError, KeyError, IndexError):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return Host("unknown", False, 0, probe_error=f"probing torch failed (exit status {done.returncode}): {last}")


def skip_reason(check: Check, host: Host, *, bench_has_device: Callable[[], bool]) -> str:
    """Why ``check`` cannot run on ``host`` ("" when it can). ``bench_has_device`` is asked only when needed."""
    for need in check.requires:
        if need == "cuda" and not host.cuda_available:
            if host.probe_error:
                return host.probe_error
            return f"torch.cuda.is_available() is False (torch {host.torch_version})"
        if need == "multi_gpu":
            if not host.nccl_available:
                return f"torch.distributed.is_nccl_available() is False (torch {host.torch_version})"
            if host.gpus < 2:
                return f"{host.gpus} CUDA device(s); NCCL needs one GPU per rank, so its multi-rank tests need ≥ 2"
        if need == "bench_device" and not bench_has_device():
            return "bench_engine has no --device (helper E's flag is not on this branch)"
    return ""


def bench_has_device_flag(python: str = sys.executable) -> bool:
    """Whether ``bench_engine.py --help`` lists ``--device``."""
    try:
        done = subprocess.run(
            [python, "benchmarks/bench_engine.py", "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO_ROOT,
            env=_env(),
        )
    except (subprocess.TimeoutExpired, OSError):
        return False
    return done.returncode == 0 and "--device" in done.stdout


# --- the checks ---------------------------------------------------------------------------------------------------
def plan_checks(python: str = sys.executable, *, quick: bool = False) -> list[Check]:
    """The five checks in order. ``--quick``: stop each pytest at its first failure, skip the slow tests and time one
    short benchmark round."""
    pytest = (python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-o", "addopts=")
    marks = ("-m", "cuda and not slow") if quick else ("-m", "cuda")
    stop = ("-x",) if quick else ()
    world1 = (
        *pytest,
        *marks,
        *stop,
        "tests/cuda",
        *EXISTING_CUDA_TESTS,
        f"--ignore={GLOO_CUDA_TESTS}",
        f"--ignore={NCCL_TESTS}",
    )
    bench = (python, "benchmarks/bench_engine.py", "--device", "cuda")
    bench += ("--rounds", "1", "--steps", "3", "--warmup", "1") if quick else ("--rounds", "3")
    compression = (python, "benchmarks/bench_compression_speed.py", "--device", "cuda", "--micro-batch", "1")
    compression += ("--bandwidths", "1,10", *(("--rounds", "1", "--steps", "2") if quick else ("--rounds", "5")))
    return [
        Check("cuda-world1", world1, 200.0, ("cuda",)),
        Check("gloo-cuda", (*pytest, *marks, *stop, GLOO_CUDA_TESTS), 120.0, ("cuda",)),
        Check("nccl", (*pytest, *marks, *stop, NCCL_TESTS), 150.0, ("cuda", "multi_gpu")),
        Check("bench-cuda", bench, 240.0, ("cuda", "bench_device"), kind="bench"),
        Check("bench-compression-cuda", compression, 180.0, ("cuda",), kind="bench"),
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(REPO_ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["SHARDSPEED_TEST_CUDA"] = "1"  # tests/conftest.py hides CUDA from the (CPU) suite otherwise
    return env


_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
_PYTEST_SKIP = re.compile(r"^SKIPPED \[\d+\] (.*)$", re.MULTILINE)


def pytest_counts(output: str) -> dict[str, int]:
    """The counts of pytest's last summary line (``3 passed, 2 skipped in 4.1s``); {} if there is none."""
    for line in reversed(output.strip().splitlines()):
        found = _PYTEST_COUNT.findall(line)
        if found and (" in " in line or line.startswith("=")):
            counts: dict[str, int] = {}
            for number, word in found:
                key = "errors" if word.startswith("error") else word
                counts[key] = counts.get(key, 0) + int(number)
            return counts
    return {}


def judge(check: Check, returncode: int, output: str, seconds: float) -> Result:
    """A finished subprocess's result: pytest's counts (all skipped = skipped, with the first reason), the bench's
    exit status."""
    tail = output[-TAIL_CHARS:]
    if check.kind != "pytest":
        ok = returncode == 0
        figures = "rows timed" if ok and check.kind == "bench" else f"exit status {returncode}"
        return Result(check.name, "passed" if ok else "failed", figures, seconds, "", returncode, tail)
    counts = pytest_counts(output)
    figures = ", ".join(f"{n} {word}" for word, n in counts.items()) or f"exit status {returncode}"
    skips = _PYTEST_SKIP.findall(output)
    if returncode == 0 and counts.get("passed", 0) == 0 and counts.get("skipped", 0) > 0:
        reason = skips[0] if skips else "every test skipped"
        return Result(check.name, "skipped", figures, seconds, reason, returncode, tail, skips)
    if returncode == 5:  # pytest: no tests collected
        return Result(check.name, "skipped", figures, seconds, "no tests collected", returncode, tail, skips)
    result = "passed" if returncode == 0 else "failed"
    return Result(check.name, result, figures, seconds, "", returncode, tail, skips)


def run_check(check: Check, timeout_s: float) -> Result:
    """Run one check's subprocess (its own session, so a timeout kills the ranks it started too)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        check.argv,
        cwd=REPO_ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output, _ = proc.communicate()
        seconds = time.monotonic() - start
        tail = (output or "")[-TAIL_CHARS:]
        reason = f"no result within {timeout_s:.0f} s (killed)"
        return Result(check.name, "timeout", reason, seconds, reason, None, tail)
    return judge(check, proc.returncode, output or "", time.monotonic() - start)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the check's process group (pytest and the ranks it spawned), then the process itself if it is left."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def run_checks(
    checks: Sequence[Check],
    host: Host,
    *,
    budget_s: float = DEFAULT_BUDGET_S,
    bench_has_device: Callable[[], bool] = bench_has_device_flag,
    echo: Callable[[str], None] = print,
    min_start_s: float = 10.0,
) -> list[Result]:
    """Each check in order, skipped with its reason where the host lacks what it needs; a check gets at most what
    is left of the budget, and none starts with under ``min_start_s`` left."""
    deadline = time.monotonic() + budget_s
    results = []
    for check in checks:
        reason = skip_reason(check, host, bench_has_device=bench_has_device)
        left = deadline - time.monotonic()
        if not reason and left < min_start_s:
            reason = f"the {budget_s:.0f} s budget is spent"
        if reason:
            results.append(Result(check.name, "skipped", "", 0.0, reason))
            echo(f"{check.name}: skipped: {reason}")
            continue
        echo(f"{check.name}: running {' '.join(check.argv[1:])} (timeout {min(check.timeout_s, left):.0f} s)")
        result = run_check(check, min(check.timeout_s, left))
        results.append(result)
        echo(f"{check.name}: {result.result} {result.figures} ({result.seconds:.1f} s)")
    return results


# --- the table ----------------------------------------------------------------------------------------------------
def format_table(results: Sequence[Result], host: Host) -> str:
    """One summary table (check, result, figures, seconds); a skipped check's reason is its figures."""
    gpus = ", ".join(host.gpu_names) if host.gpu_names else "no CUDA device"
    rows = [("check", "result", "figures", "seconds")]
    for r in results:
        figures = r.figures if r.result != "skipped" or not r.reason else f"{r.reason}"
        if r.result == "skipped" and r.figures and r.reason:
            figures = f"{r.reason} ({r.figures})"
        rows.append((r.name, r.result, figures, f"{r.seconds:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [f"gpu-check: torch {host.torch_version}; {gpus}"]
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[j]) if j < 3 else cell.rjust(widths[j]) for j, cell in enumerate(row)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    total = sum(r.seconds for r in results)
    lines.append(f"total {total:.1f} s; exit status {exit_status(results)}")
    return "\n".join(lines)


def exit_status(results: Sequence[Result]) -> int:
    """1 when any check failed or timed out, else 0 (skips are not failures: a CPU-only host exits 0)."""
    return 1 if any(r.result in ("failed", "timeout") for r in results) else 0


def main(
    argv: Sequence[str] | None = None,
    *,
    checks: Sequence[Check] | None = None,
    host: Host | None = None,
    bench_has_device: Callable[[], bool] = bench_has_device_flag,
) -> int:
    """The command. ``checks`` / ``host`` / ``bench_has_device`` stand in for the real ones in the driver's tests."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="first failure stops a check; one short bench round")
    parser.add_argument("--json", metavar="OUT", default=None, help="also write the results as JSON to OUT")
    parser.add_argument(
        "--budget-s", type=float, default=DEFAULT_BUDGET_S, help=f"all checks together (default {DEFAULT_BUDGET_S})"
    )
    args = parser.parse_args(argv)
    host = host if host is not None else probe_host()
    checks = checks if checks is not None else plan_checks(quick=args.quick)
    results = run_checks(checks, host, budget_s=args.budget_s, bench_has_device=bench_has_device)
    benches = {c.name for c in checks if c.kind == "bench"}
    for r in results:  # details first, so the summary table is the last thing printed
        if r.result in ("failed", "timeout"):
            print(f"\n--- {r.name}: {r.result}; last lines of its output ---\n{r.output_tail[-2000:]}")
        elif r.name in benches and r.result == "passed":  # the benchmark's own table of rows
            print(f"\n--- {r.name} ---\n{r.output_tail[-3000:]}")
        if r.notes and r.result != "skipped":  # tests skipped inside a check that ran: e.g. ops gloo refuses on CUDA
            print(f"\n--- {r.name}: skipped tests ---\n" + "\n".join(dict.fromkeys(r.notes)))
    print()
    print(format_table(results, host))
    if args.json:
        payload = {"host": asdict(host), "results": [asdict(r) for r in results], "exit_status": exit_status(results)}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
