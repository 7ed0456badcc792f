"""DeepSpeed's rows of ``bench_pipe.py``: ``deepspeed.pipe.PipelineModule`` + ``train_batch`` on the same GPT,
split and micro-batching, under a venv holding DeepSpeed 0.19.8 (the command is in ``bench_pipe.py``'s docstring).

Started by ``bench_pipe.py`` as ``<ds python> -m torch.distributed.run --nproc_per_node 2 deepspeed_pipe_worker.py
...`` with ``DS_ACCELERATOR=cpu`` (gloo). Imports nothing from shardspeed: the layers come from
``tests/dist/pipe_models.py`` (torch-only at import), the timing helpers from ``bench_pipe.py``.

Idle time: DeepSpeed's pipeline engine sends and receives with blocking ``deepspeed.runtime.pipe.p2p.send`` /
``recv`` (called through the module attribute), so the worker wraps both with a clock; the figure holds the
transfers themselves as well as the waiting (there is no posting apart from the wait, so p2p post time is 0).
Peak memory: VmHWM growth from before the module is built to after the last step; the launcher starts one
process per m, so each m's figure starts from a fresh process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_pipe import (
    ADAMW,
    BASE_SEED,
    SIZES,
    BenchSize,
    Side,
    StepFigures,
    WaitClock,
    cycled,
    gpt_loss_fn,
    parse_args,
    slowest_loss,
    time_round,
)
from bench_pipe_report import DEEPSPEED_SIDE
from proc_status import read_status_mib


def _seed(seed: object) -> None:
    """DeepSpeed 0.19.8's default ``set_random_seed`` fails under numpy 2: the layer index it adds is a numpy
    integer, which ``random.seed`` refuses; the layers draw only from torch's generator."""
    torch.manual_seed(int(seed))


def build_deepspeed_side(size: BenchSize, micro_batches: int, clock: WaitClock) -> tuple[Side, Any]:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    specs = [LayerSpec(p.cls, *p.args) for p in size.plan()]
    module = PipelineModule(
        specs,
        num_stages=2,
        loss_fn=gpt_loss_fn,
        seed_layers=True,
        seed_fn=_seed,
        base_seed=BASE_SEED,
        partition_method="type:Block",
    )
    optimizer = torch.optim.AdamW(module.parameters(), **ADAMW)
    config = {
        "train_micro_batch_size_per_gpu": size.micro_batch,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": size.micro_batch * micro_batches,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    data = cycled(size, micro_batches)

    def run_step() -> float:
        return float(engine.train_batch(data))

    def figures(wall: float) -> StepFigures:
        return StepFigures(wall, clock.take(), 0.0)

    return Side(DEEPSPEED_SIDE, run_step, figures), [int(p) for p in module.parts]


def install_deepspeed_clock() -> WaitClock:
    from deepspeed.runtime.pipe import p2p

    clock = WaitClock()
    p2p.send = clock.wrap(p2p.send)
    p2p.recv = clock.wrap(p2p.recv)
    return clock


def run(args: argparse.Namespace) -> dict[str, Any]:
    import deepspeed

    size = SIZES[args.model]
    deepspeed.init_distributed(dist_backend="gloo")
    clock = install_deepspeed_clock()
    out: dict[str, Any] = {}
    for m in args.micro_batches:
        gc.collect()
        baseline = read_status_mib("VmHWM")
        side, parts = build_deepspeed_side(size, m, clock)
        for _ in range(max(args.warmup, 2)):
            side.step()
        rounds = []
        for r in range(args.repeats):
            rounds.append(time_round(side, args.steps))
            if dist.get_rank() == 0:
                print(f"deepspeed m={m} round {r + 1}/{args.repeats}: {rounds[-1]['step_ms']:.1f} ms", flush=True)
        grown: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(grown, read_status_mib("VmHWM") - baseline)
        out[str(m)] = {
            "rounds": rounds,
            "first_losses": slowest_loss(side.first_losses),
            "parts": parts,
            "growth_mib": grown,  # clean only for the first m of a process: the launcher runs one m per process
        }
    return {"by_m": out, "version": deepspeed.__version__, "model": size.describe()}


def main() -> None:
    args = parse_args(__import__("sys").argv[1:])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = run(args)
    if dist.get_rank() == 0 and args.result_file:
        Path(args.result_file).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
