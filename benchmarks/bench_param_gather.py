"""Exposed parameter-gather time per step, ZeRO-1/2, ``overlap_param_gather`` off vs on (issue 16's comm-bound MLP).

One command (world 2, gloo, one thread per rank)::

    PYTHONPATH=src python benchmarks/bench_param_gather.py [--steps 20] [--bucket 1050000]

For each stage and setting, every rank trains the 6.3M-parameter MLP (6 × Linear(1024, 1024), batch 32 = 16 per
rank, fp32 AdamW) and reads ``engine.collectives.blocked``: the wall time the training thread sat blocked waiting
for the parameter gathers (every key with tag ``params``), per step, and the step time (forward + backward + step).
Rows are interleaved (off, on, off, on, … per round) so load drifts hit both alike; the figure is the median over
rounds of the per-round mean. ``--bucket``: ``reduce_bucket_size`` / ``allgather_bucket_size`` (default: one layer
per bucket, so later layers' gathers can hide behind earlier layers' compute; with one bucket for the whole model
the first layer waits for everything and only the gap between ``step()`` and the next forward is hidden).
Timing figures are only as good as the machine is quiet.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

WIDTH, LAYERS, BATCH, WORLD = 1024, 6, 32, 2


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _measure(stage: int, overlap: bool, bucket: int, steps: int, rank: int) -> tuple[float, float]:
    """(ms blocked on parameter gathers per step, ms per step) for one engine, after two warm-up steps."""
    import shardspeed

    config = {
        "train_micro_batch_size_per_gpu": BATCH // WORLD,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": stage,
            "overlap_param_gather": overlap,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
        },
        "steps_per_print": 10**9,
    }
    model = mlp()
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH // WORLD, WIDTH, generator=g), torch.randn(BATCH // WORLD, WIDTH, generator=g)

    def step() -> None:
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()

    for _ in range(2):
        step()
    blocked = engine.collectives.blocked
    blocked.reset()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    wall = time.perf_counter() - start
    params = sum(s for k, s in blocked.seconds.items() if k.endswith(":params"))
    engine.destroy()
    return params / steps * 1e3, wall / steps * 1e3


def _worker(rank: int, store: str, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    rows: dict[tuple[int, bool], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for stage in (1, 2):
            for overlap in (False, True):
                rows.setdefault((stage, overlap), []).append(_measure(stage, overlap, args.bucket, args.steps, rank))
    out[rank] = rows
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per engine")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (off, on) per stage")
    parser.add_argument("--bucket", type=int, default=WIDTH * WIDTH + WIDTH, help="bucket size in elements")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), args, out), nprocs=WORLD, join=True)
        results = dict(out)
    print(f"MLP {LAYERS}×Linear({WIDTH},{WIDTH}) = {sum(p.numel() for p in mlp().parameters()) / 1e6:.1f}M params, ")
    print(f"world {WORLD} gloo, batch {BATCH}, fp32 AdamW, bucket {args.bucket} elements, {args.rounds} rounds × ")
    print(f"{args.steps} steps; medians over rounds (rank 0 | rank 1)\n")
    print(f"{'stage':<7}{'overlap_param_gather':<22}{'blocked params ms/step':<30}{'step ms':<20}")
    for stage in (1, 2):
        for overlap in (False, True):
            cells = []
            for index in (0, 1):
                per_rank = [statistics.median(v[index] for v in results[r][(stage, overlap)]) for r in range(WORLD)]
                cells.append(" | ".join(f"{v:7.2f}" for v in per_rank))
            print(f"{stage:<7}{str(overlap).lower():<22}{cells[0]:<30}{cells[1]:<20}")


if __name__ == "__main__":
    main()
