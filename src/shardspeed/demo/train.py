"""The demo's training run, inside one torch.distributed worker: written exactly as a DeepSpeed user would.

``shardspeed.initialize`` gets the model, its parameters, the training dataset and a DeepSpeed-style config
dict; the loop is the familiar ``loss = engine(x, y); engine.backward(loss); engine.step()`` over a
``RepeatingLoader``. Everything else here is measurement: a held-out loss before and after, and periodic
statistics for the progress bar and the summary.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

import shardspeed
from shardspeed.comm import init_distributed
from shardspeed.demo.corpus import ByteWindows, byte_tokens, read_corpus, train_eval_split
from shardspeed.demo.model import GPT, TINY_CONFIG, GPTConfig
from shardspeed.demo.observe import (
    agree_run_dir,
    close_monitors,
    mfu_line,
    observability_sections,
    prepare_run_dir,
    write_run_report,
)
from shardspeed.demo.progress import ProgressBar, RunSummary, gather_stats, read_memory_mb

COMMS_LOG_NOTE = (
    "(the table includes start-up broadcasts; evaluation forwards are their own '(eval)' rows, outside the theory "
    "line. At stage 3 a ratio near 2/3 is expected: a unit still gathered when backward reaches it (within "
    "stage3_max_reuse_distance, default 1e9) is not gathered again, so a step moves 2Ψ·(N−1)/N, not 3Ψ.)"
)


def model_config(args: argparse.Namespace) -> GPTConfig:
    """--tiny picks the tiny preset; explicit size flags override either preset."""
    base = TINY_CONFIG if args.tiny else GPTConfig()
    return GPTConfig(
        context_length=args.context or base.context_length,
        n_layer=args.layers or base.n_layer,
        d_model=args.d_model or base.d_model,
        n_head=args.heads or base.n_head,
    )


def warmup_steps(args: argparse.Namespace) -> int:
    return args.warmup if args.warmup is not None else max(1, min(30, args.steps // 10))


def deepspeed_config(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON a DeepSpeed user would write; ``--stage`` goes straight to ``zero_optimization.stage``."""
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "optimizer": {
            "type": "Adam",  # DeepSpeed's Adam decouples weight decay (AdamW) by default
            "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": args.weight_decay},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": args.lr,
                "warmup_num_steps": warmup_steps(args),
                "warmup_type": "linear",
                "total_num_steps": args.steps,
            },
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": bool(args.bf16)},
        "steps_per_print": 1_000_000_000,  # the demo draws its own progress bar
        **({"comms_logger": {"enabled": True}} if getattr(args, "comms_log", False) else {}),
    }


@torch.no_grad()
def evaluate(engine: Any, windows: ByteWindows, *, max_windows: int, micro_batch_size: int) -> float:
    """Mean loss over up to ``max_windows`` held-out windows, split evenly across the data-parallel ranks.

    Every rank runs the same number of forward passes (ZeRO-3 gathers parameters collectively in forward,
    so unequal counts would hang), then one all-reduce combines the sums.
    """
    rank, world = engine.topology.dp_rank, engine.topology.dp_world_size
    per_rank = min(len(windows), max_windows) // world // micro_batch_size * micro_batch_size
    loss_sum = torch.zeros((), dtype=torch.float64, device=engine.device)
    engine.eval()
    for start in range(0, per_rank, micro_batch_size):
        indices = [rank + world * i for i in range(start, start + micro_batch_size)]
        inputs = torch.stack([windows[i][0] for i in indices]).to(engine.device)
        targets = torch.stack([windows[i][1] for i in indices]).to(engine.device)
        loss_sum += engine(inputs, targets).double()
    engine.train()
    totals = torch.stack([loss_sum, torch.tensor(float(per_rank // micro_batch_size), device=engine.device)])
    if world > 1:
        dist.all_reduce(totals, group=engine.topology.dp_group)
    return (totals[0] / totals[1]).item() if totals[1] > 0 else math.nan


def log_interval(args: argparse.Namespace) -> int:
    """Statistics every ``--log-every`` steps, but at least four times per run so first/last differ."""
    return max(1, min(args.log_every, args.steps // 4))


def run(args: argparse.Namespace) -> int:
    """Train; return the exit code (0 when the training loss went down, 1 when it did not)."""
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    config = model_config(args)
    tokens = byte_tokens(read_corpus(int(args.corpus_mb * 1_000_000)))
    train_set, eval_set = train_eval_split(tokens, config.context_length)
    model = GPT(config)
    if args.run_dir is None:  # a worker started by a launcher: rank 0 picks the directory, shared over the group
        init_distributed()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    run_dir = agree_run_dir(args.run_dir, torch.device("cuda", local) if torch.cuda.is_available() else None)
    ds_config = {**deepspeed_config(args), **observability_sections(run_dir, args.steps, args.wandb)}
    prepare_run_dir(run_dir, ds_config, int(os.environ.get("RANK", "0")) == 0, args.wandb)
    engine, _optimizer, loader, _scheduler = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        training_data=train_set,
        config=ds_config,
    )
    topology, device = engine.topology, engine.device
    is_rank0 = topology.dp_rank == 0
    summary = RunSummary(
        world_size=topology.dp_world_size,
        stage=args.stage,
        precision="bf16" if args.bf16 else "fp32",
        backend=f"{dist.get_backend() if dist.is_initialized() else 'no process group'}, {device.type}",
        model_description=(
            f"{model.num_parameters() / 1e6:.2f}M parameters: {config.n_layer} layers, d_model "
            f"{config.d_model}, {config.n_head} heads, context {config.context_length}, byte vocabulary"
        ),
    )
    summary.eval_loss_before = evaluate(
        engine, eval_set, max_windows=args.eval_windows, micro_batch_size=args.micro_batch
    )
    if is_rank0:
        print(
            f"training {summary.model_description} on {len(train_set)} windows of Python stdlib source "
            f"({len(tokens) / 1e6:.1f} MB); eval loss at start {summary.eval_loss_before:.3f}",
            flush=True,
        )

    tokens_per_step = args.micro_batch * args.grad_accum * topology.dp_world_size * config.context_length
    every = log_interval(args)
    bar = ProgressBar(args.steps, enabled=is_rank0)
    losses: list[float] = []  # data-parallel mean per statistics window
    window_loss = torch.zeros((), device=device)
    window_micro_steps = 0
    steps = steps_at_sync = 0
    train_started = last_sync = time.perf_counter()
    engine.train()
    try:
        for inputs, targets in shardspeed.RepeatingLoader(loader):
            loss = engine(inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True))
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()  # DeepSpeed semantics: ask before step()
            engine.step()
            window_loss += loss.detach().float()
            window_micro_steps += 1
            if not boundary:
                continue
            steps += 1
            if steps % every and steps < args.steps:
                continue
            now = time.perf_counter()
            over_budget = args.time_budget > 0 and now - started > args.time_budget
            stats = gather_stats(
                window_loss.item(),
                window_micro_steps,
                read_memory_mb("VmRSS"),
                over_budget,
                group=topology.dp_group,
                world_size=topology.dp_world_size,
                device=device,
            )
            losses.append(stats.mean_loss)
            bar.update(
                steps - steps_at_sync,
                loss=stats.mean_loss,
                tokens_per_second=(steps - steps_at_sync) * tokens_per_step / max(now - last_sync, 1e-9),
                memory_mb=stats.memory_mb,
                lr=engine.get_lr()[0],
            )
            window_loss.zero_()
            window_micro_steps, steps_at_sync, last_sync = 0, steps, now
            if steps >= args.steps or stats.stop:
                summary.stopped_by_time_budget = steps < args.steps
                break
    finally:
        bar.close()
        loader.close()
    summary.train_seconds = time.perf_counter() - train_started
    summary.steps = steps
    summary.smoothing_steps = every
    summary.first_loss, summary.last_loss = losses[0], losses[-1]
    summary.tokens_per_second = steps * tokens_per_step / max(summary.train_seconds, 1e-9)
    summary.eval_loss_after = evaluate(
        engine, eval_set, max_windows=args.eval_windows, micro_batch_size=args.micro_batch
    )
    peaks = gather_stats(
        0.0,
        0,
        read_memory_mb("VmHWM"),
        False,
        group=topology.dp_group,
        world_size=topology.dp_world_size,
        device=device,
    )
    summary.peak_memory_mb = peaks.memory_mb
    samples_per_step = args.micro_batch * args.grad_accum * topology.dp_world_size
    samples_per_second = steps * samples_per_step / max(summary.train_seconds, 1e-9)
    close_monitors(engine)
    summary.wall_seconds = time.perf_counter() - started
    if is_rank0:
        summary.run_dir = str(run_dir)
        # rank 0 only: the peak-FLOPs probe behind it is a CPU matmul that only the printed table needs
        summary.mfu = mfu_line(engine, samples_per_second, dist.get_world_size() if dist.is_initialized() else 1)
        print(summary.table(), flush=True)
        if not summary.loss_went_down:
            print("shardspeed.demo: the training loss did not go down", flush=True)
        if engine.comms_log.enabled:
            print("\ncomms log (rank 0, every logged collective since the start):\n" + engine.comms_log.summary())
            print(COMMS_LOG_NOTE, flush=True)
        print(write_run_report(run_dir), flush=True)
    return 0 if summary.loss_went_down else 1
