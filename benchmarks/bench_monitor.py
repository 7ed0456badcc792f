"""Monitor overhead (issue #17): the demo GPT trained with all three monitors (TensorBoard, CSV, W&B offline) vs
without, on 2 gloo ranks, in interleaved rounds.

    python benchmarks/bench_monitor.py                 # 7 rounds × 10 steps, the demo's small GPT
    python benchmarks/bench_monitor.py --rounds 9 --steps 20 --model medium

Two engines per rank from the same weights and batches: ``plain`` (no monitor) and ``monitored`` (tensorboard +
csv_monitor + wandb, ``WANDB_MODE=offline`` under a temporary directory). Each round trains ``--steps`` steps on
both, in an order that alternates per round. Two figures, each a median over rounds with its interquartile range:

- inside / step: the wall time spent inside the monitor listener (``engine.monitor.listener.seconds_inside``: a
  perf_counter around its whole per-step work on the training thread — events built, the per-rank memory gather
  launched and the last one collected, every monitor's write: CSV rows and flush, TensorBoard events queued to its
  writer thread, W&B events queued to ours) divided by the monitored engine's step time, on the writing rank
  (rank 0). Target: <= 2%.
- paired step ratio: monitored step time / plain step time in the same round: the listener's cost plus what runs
  elsewhere (the writer threads' CPU time, the forward pre-hook reading the batch shape, the gradient norm every
  step — free here: the demo clips); on a shared machine mostly noise.

Rank 0 prints the table. Timings on a machine shared with other jobs are indicative only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from bench_models import MODEL_SIZES, ModelSize  # noqa: E402
from launch_util import child_env, free_port  # noqa: E402
from stats import interquartile_range, median, summarize_ratios  # noqa: E402


def _engine(template: torch.nn.Module, size: ModelSize, monitors: dict[str, Any]) -> Any:
    import copy

    import shardspeed

    config = {
        "train_micro_batch_size_per_gpu": size.micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "gradient_clipping": 1.0,  # the demo's config: the norm is computed every step either way
        "zero_optimization": {"stage": 1},
        "steps_per_print": 1_000_000,
        **monitors,
    }
    engine, *_ = shardspeed.initialize(model=copy.deepcopy(template), config=config)
    return engine


def _train(engine: Any, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
    return time.perf_counter() - started


def rank_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    from shardspeed.demo.model import GPT, GPTConfig

    size = MODEL_SIZES[args.model]
    assert isinstance(size, ModelSize)
    torch.manual_seed(0)
    template = GPT(
        GPTConfig(context_length=size.context_length, n_layer=size.n_layer, d_model=size.d_model, n_head=size.n_head)
    )
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    tokens = torch.randint(0, 256, (size.micro_batch, size.context_length + 1), generator=g)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    root = args.run_dir
    os.environ.update({"WANDB_MODE": "offline", "WANDB_DIR": root, "WANDB_SILENT": "true"})
    where = {"output_path": root, "job_name": "bench"}
    monitors = {
        "tensorboard": {"enabled": True, **where},
        "csv_monitor": {"enabled": True, **where},
        "wandb": {"enabled": True, "project": "shardspeed-bench"},
    }
    engines = {"plain": _engine(template, size, {}), "monitored": _engine(template, size, monitors)}
    for engine in engines.values():
        _train(engine, batch, args.warmup)
    times: dict[str, list[float]] = {"plain": [], "monitored": []}
    inside: list[float] = []
    for r in range(args.rounds):
        order = ["plain", "monitored"] if r % 2 == 0 else ["monitored", "plain"]
        for name in order:
            listener = engines[name].monitor.listener
            before = listener.seconds_inside
            dist.barrier()
            times[name].append(_train(engines[name], batch, args.steps) / args.steps)
            if name == "monitored":
                inside.append((listener.seconds_inside - before) / args.steps)
    written = engines["monitored"].monitor.listener.steps_written
    for engine in engines.values():
        engine.destroy()
    if dist.get_rank() == 0:
        result = {"times": times, "inside": inside, "steps_written": written, "args": vars(args)}
        Path(args.result_file).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def report(result: dict[str, Any]) -> str:
    times, inside = result["times"], result["inside"]
    fractions = [i / t for i, t in zip(inside, times["monitored"])]
    q25, q75 = interquartile_range(fractions)
    ratio = summarize_ratios(times["monitored"], times["plain"])
    a = result["args"]
    lines = [
        f"monitor overhead: demo GPT '{a['model']}', 2 gloo ranks, {a['rounds']} rounds × {a['steps']} steps "
        "(tensorboard + csv_monitor + wandb offline vs none)",
        f"  step time plain      median {1e3 * median(times['plain']):8.1f} ms",
        f"  step time monitored  median {1e3 * median(times['monitored']):8.1f} ms",
        f"  inside the monitor   median {1e3 * median(inside):8.2f} ms per step (rank 0, the writer)",
        f"  inside / step        median {100 * median(fractions):6.2f}%  (IQR {100 * q25:.2f}-{100 * q75:.2f}%)  "
        f"target <= 2%: {'met' if median(fractions) <= 0.02 else 'NOT met'}",
        f"  paired step ratio    median {ratio.median:6.3f}   (IQR {ratio.q25:.3f}-{ratio.q75:.3f}) monitored/plain",
        f"  steps written by the monitored engine: {result['steps_written']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="small", choices=[k for k, v in MODEL_SIZES.items() if isinstance(v, ModelSize)]
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_worker:
        rank_main(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench_monitor_") as tmp:
        result_file = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        command += ["--master_port", str(free_port()), str(Path(__file__).resolve()), "--rank-worker"]
        command += ["--model", args.model, "--rounds", str(args.rounds), "--steps", str(args.steps)]
        command += ["--warmup", str(args.warmup), "--result-file", str(result_file), "--run-dir", tmp]
        completed = subprocess.run(command, env=child_env(paths=[REPO_ROOT / "benchmarks"]), check=False)
        if completed.returncode != 0:
            raise SystemExit(f"bench_monitor: the ranks failed (exit code {completed.returncode}); see above")
        print(report(json.loads(result_file.read_text())))


if __name__ == "__main__":
    main()
