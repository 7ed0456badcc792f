"""The flops profiler on the demo GPT, one process: is the count exact, what does profiling one step cost, MFU.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_flops_profiler.py [--device cuda --dtype bf16]

Trains the demo GPT (its default size) through ``shardspeed.initialize`` with ``flops_profiler`` on at
``profile_step``; prints the model FLOPs per sample next to the closed form ``6·T·W + 12·L·s·d·T`` (they must be
equal: [Note: the causal rule]), the peak and where it came from, MFU at the median unprofiled step time, and the
profiled step's time over the median (the cost of profiling one step: dispatch-mode and per-module hooks). Figures
measured on a shared machine are indicative.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from pathlib import Path

import torch

import shardspeed
from shardspeed.demo.model import GPT, GPTConfig
from shardspeed.profiling.mfu import model_flops_utilization

DTYPES = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}}


def closed_form(model: GPT, seq: int) -> int:
    """Per sample of ``seq`` tokens: 6·T·W + 12·L·s·d·T (W: matmul weights, the tied head once)."""
    cfg = model.config
    weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "position" not in n)
    return 6 * seq * weights + 12 * cfg.n_layer * seq * cfg.d_model * seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--profile-step", type=int, default=4)
    args = parser.parse_args()
    if args.device == "cpu":
        import os

        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the engine picks a visible GPU otherwise
    torch.manual_seed(0)
    cfg = GPTConfig()
    out = Path(tempfile.mkdtemp(prefix="flops-bench-")) / "flops_profile.txt"
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "flops_profiler": {"enabled": True, "profile_step": args.profile_step, "output_file": str(out)},
        "steps_per_print": 10_000,
        **DTYPES[args.dtype],
    }
    engine, *_ = shardspeed.initialize(model=GPT(cfg), config=config)
    g = torch.Generator().manual_seed(1)
    times: list[float] = []
    profiled_s = 0.0
    for step in range(args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.context_length), generator=g)
        tokens = tokens.to(engine.device)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # the summary goes to the output file
            engine.backward(engine(tokens, tokens))
            engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if step == args.profile_step:
            profiled_s = elapsed
        elif step >= 2:  # warm-up steps left out
            times.append(elapsed)
    prof = engine.flops_profiler
    per_sample = prof.model_flops_per_sample
    expected = closed_form(engine.module, cfg.context_length)
    median = statistics.median(times)
    samples_per_s = args.micro_batch / median
    mfu = model_flops_utilization(per_sample, samples_per_s, 1, prof.peak_flops)
    print(
        f"demo GPT {engine.module.num_parameters() / 1e6:.2f}M params, micro batch {args.micro_batch} × "
        f"{cfg.context_length} tokens, {args.device} {args.dtype}, torch threads {torch.get_num_threads()}"
    )
    verdict = "equal" if per_sample == expected else "DIFFERENT"
    print(f"model flops per sample   {per_sample:,.0f} (closed form {expected:,}: {verdict})")
    print(f"peak                     {prof.peak_flops / 1e9:,.1f} GFLOPS ({prof.peak_source})")
    print(f"median step              {1000 * median:.1f} ms ({samples_per_s:.1f} samples/s)")
    print(f"MFU                      {100 * mfu:.2f}%")
    print(f"profiled step / median   {profiled_s / median:.2f}x ({1000 * profiled_s:.1f} ms)")
    print(f"summary written to       {out}")


if __name__ == "__main__":
    main()
