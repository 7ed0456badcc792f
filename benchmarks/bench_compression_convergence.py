"""Convergence of the 1-bit optimizers against themselves with compression off (issue 18).

The demo GPT (src/shardspeed/demo/model.py; by default 2 layers, d_model 64, seq 64, global batch 16) on the
stdlib corpus, at world 2 and 4 on gloo, ``freeze_step`` = 15% of the run, 3 seeds; per variant and world one
torchrun job (benchmarks/compression_convergence_worker.py) runs every seed with compression on and off, so the
processes start once. What "off" means per optimizer: [Note: compression off] in the worker.

Final loss = mean of the last 10% of steps' training losses (mean over ranks), averaged over seeds. A row passes
when |final(on) − final(off)| ≤ max(2% of final(off), 2 × spread), spread = the larger of the on and off runs'
ranges (max − min) over seeds. Loss curves (mean over seeds, min–max band) go to a PNG.

  python benchmarks/bench_compression_convergence.py [--optimizers onebitadam,zerooneadam,onebitlamb,
      zero2-onebitadam] [--worlds 2,4] [--steps 300] [--seeds 3] [--out runs/compression-convergence]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from launch_util import REPO_ROOT, child_env, free_port

WORKER = Path(__file__).with_name("compression_convergence_worker.py")
ALL = ("onebitadam", "zerooneadam", "onebitlamb", "zero2-onebitadam")


def final_loss(losses: list[float]) -> float:
    tail = max(1, len(losses) // 10)
    return statistics.fmean(losses[-tail:])


def row(result: dict[str, Any]) -> dict[str, Any]:
    """One table row from a worker's runs: finals per mode, Δ, the threshold and the verdict."""
    finals = {
        mode: [final_loss(r["losses"]) for r in result["runs"] if r["compressed"] == (mode == "on")]
        for mode in ("on", "off")
    }
    on, off = statistics.fmean(finals["on"]), statistics.fmean(finals["off"])
    spread = max(max(v) - min(v) for v in finals.values())
    threshold = max(0.02 * off, 2 * spread)
    delta = abs(on - off)
    return {
        "variant": result["variant"], "world": result["world"], "on": on, "off": off, "delta": delta,
        "spread": spread, "threshold": threshold, "pass": delta <= threshold, "seeds": len(finals["on"]),
    }  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'variant':<18} {'world':>5} {'seeds':>5} {'on':>8} {'off':>8} {'|Δ|':>8} {'spread':>8} {'limit':>8}  result"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['variant']:<18} {r['world']:>5} {r['seeds']:>5} {r['on']:>8.4f} {r['off']:>8.4f} {r['delta']:>8.4f} "
            f"{r['spread']:>8.4f} {r['threshold']:>8.4f}  {'PASS' if r['pass'] else 'FAIL'}"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Loss curves: one panel per (variant, world), mean over seeds with the min–max band, on vs off."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * len(results), 3.4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(results), squeeze=False)[0]
    for ax, res in zip(axes, results):
        for mode, color in (("on", "tab:red"), ("off", "tab:blue")):
            curves = [r["losses"] for r in res["runs"] if r["compressed"] == (mode == "on")]
            steps = range(1, len(curves[0]) + 1)
            mean = [statistics.fmean(c[i] for c in curves) for i in range(len(curves[0]))]
            ax.plot(steps, mean, color=color, lw=1, label=f"compression {mode}")
            ax.fill_between(steps, [min(c[i] for c in curves) for i in range(len(mean))],
                            [max(c[i] for c in curves) for i in range(len(mean))], color=color, alpha=0.2)  # fmt: skip
        ax.set_title(f"{res['variant']}, world {res['world']}")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_job(variant: str, world: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    result = out / f"{variant}-w{world}.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), str(WORKER), "--variant", variant, "--steps", str(args.steps),
        "--seeds", str(args.seeds), "--seq", str(args.seq), "--layers", str(args.layers), "--dim", str(args.dim),
        "--global-batch", str(args.global_batch), "--bucket", str(args.bucket), "--freeze-frac", str(args.freeze_frac),
        "--schedule", args.schedule, "--out", str(result),
    ] + (["--lr", str(args.lr)] if args.lr else [])  # fmt: skip
    subprocess.run(cmd, env=child_env(force_one_thread=True), cwd=REPO_ROOT, check=True)
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizers", default=",".join(ALL))
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--freeze-frac", type=float, default=0.15)
    p.add_argument("--bucket", type=int, default=500_000_000, help="reduce_bucket_size (1-bit scale granularity)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate for every variant (default: each's)")
    p.add_argument("--schedule", choices=("warmup", "decay"), default="warmup", help="WarmupLR or WarmupDecayLR")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "compression-convergence")
    args = p.parse_args(argv)
    sys.path.insert(0, str(WORKER.parent))
    from compression_convergence_worker import available

    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for variant in args.optimizers.split(","):
        if variant not in ALL:
            p.error(f"unknown optimizer variant {variant!r}; choose from {', '.join(ALL)}")
        if not available(variant):
            print(f"[skip] {variant}: its optimizer type is not registered in this checkout", flush=True)
            continue
        for world in (int(w) for w in args.worlds.split(",")):
            print(f"[run] {variant} world {world}: {args.seeds} seeds × on/off × {args.steps} steps", flush=True)
            results.append(run_job(variant, world, args, args.out))
    rows = [row(r) for r in results]
    text = table(rows)
    print(text)
    (args.out / "table.txt").write_text(text + "\n")
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    if results:
        plot(results, args.out / "loss_curves.png")
        print(f"loss curves: {args.out / 'loss_curves.png'}")
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
