"""Did a change make the benchmark rows slower? Paired runs of this tree against another git revision.

    python benchmarks/bench_versions.py [--base origin/main] [--pairs 7] [--rows stage0,stage1,stage2,stage3]
                                        [--model small] [--steps 10] [--warmup 3]

The base revision is checked out into a temporary git worktree. Each pair runs ``bench_engine.py``'s timing run
once from the base tree and once from this tree, back to back, in an order that alternates from pair to pair (so
slow drift of the machine does not favour one side); every run is a fresh ``torchrun`` with ``--rounds 1``. A
pair's ratio is this tree's step time / the base's, per row; the summary is the median and IQR of those ratios
(``stats.py``), i.e. the same statistic the rows themselves use against their peers, applied across versions.

The peers (DDP, ZeroRedundancyOptimizer, FSDP2) run too because ``bench_engine`` adds them; their own ratios should
sit near 1.00 and say how noisy the machine was.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from launch_util import child_env, free_port
from stats import summarize_ratios

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD~1", help="git revision to compare against (default HEAD~1)")
    parser.add_argument("--pairs", type=int, default=7, help="paired runs (default 7)")
    parser.add_argument("--rows", default="stage0,stage1,stage2,stage3", help="bench_engine rows (peers added)")
    parser.add_argument("--model", default="small", help="bench_engine model size (default small)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row per run (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per row (default 3)")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs must be at least 1, got {args.pairs}")
    return args


def timing_run(tree: Path, args: argparse.Namespace, result: Path) -> dict[str, float]:
    """One bench_engine timing run from ``tree`` (its own src/ and benchmarks/); ms per step by row."""
    env = child_env()
    env["PYTHONPATH"] = str(tree / "src")  # the tree's own package, never this checkout's
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(tree / "benchmarks" / "bench_engine.py"),
        *("--rounds", "1", "--steps", str(args.steps), "--warmup", str(args.warmup)),
        *("--model", args.model, "--rows", args.rows, "--result-file", str(result)),
    ]
    completed = subprocess.run(command, env=env, cwd=tree, check=False, capture_output=True, text=True)
    if completed.returncode != 0:
        raise SystemExit(f"bench_versions: timing run from {tree} failed:\n{completed.stdout}\n{completed.stderr}")
    timing = json.loads(result.read_text())
    return {name: times[0] for name, times in timing["step_ms"].items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    base_rev = subprocess.run(
        ["git", "rev-parse", "--short", args.base], cwd=REPO_ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="bench_versions_") as scratch:
        base_tree = Path(scratch) / "base"
        add = ["git", "worktree", "add", "--detach", "-q", str(base_tree), base_rev]
        subprocess.run(add, cwd=REPO_ROOT, check=True)
        try:
            trees = {"base": base_tree, "this": REPO_ROOT}
            times: dict[str, dict[str, list[float]]] = {"base": {}, "this": {}}
            for pair in range(args.pairs):
                order = ["base", "this"] if pair % 2 == 0 else ["this", "base"]
                for side in order:
                    step_ms = timing_run(trees[side], args, Path(scratch) / f"{side}_{pair}.json")
                    for row, ms in step_ms.items():
                        times[side].setdefault(row, []).append(ms)
                ratios = (f"{row} {times['this'][row][-1] / times['base'][row][-1]:.3f}" for row in times["this"])
                line = ", ".join(ratios)
                print(f"pair {pair + 1}/{args.pairs} ({' then '.join(order)}): this/base {line}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=REPO_ROOT, check=False)
    print(f"\nthis tree vs {args.base} ({base_rev}), model {args.model}, {args.pairs} paired runs, ms per step:")
    print(f"{'row':<18}{'base median':>12}{'this median':>12}{'ratio median':>14}{'IQR':>18}")
    for row in times["this"]:
        summary = summarize_ratios(times["this"][row], times["base"][row])
        base_ms = sorted(times["base"][row])[len(times["base"][row]) // 2]
        this_ms = sorted(times["this"][row])[len(times["this"][row]) // 2]
        iqr = f"[{summary.q25:.3f}-{summary.q75:.3f}]"
        print(f"{row:<18}{base_ms:>12.1f}{this_ms:>12.1f}{summary.median:>14.3f}{iqr:>18}")


if __name__ == "__main__":
    main()
