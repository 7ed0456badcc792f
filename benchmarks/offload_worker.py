"""One rank of an NVMe-offload run (tests/e2e/test_offload_bounded_memory.py, benchmarks/bench_scale.py; run under
torchrun): trains an fp32 model built under
``shardspeed.zero.Init`` with ZeRO-3 + NVMe parameter and optimizer offload while a thread samples this process's
RssAnon, and writes its baseline (right after imports), peak, losses, step times and where each step's time went
(forward, backward, optimizer; inside the optimizer: blocked on reads, CPU Adam, blocked on writes; the swap
files' I/O seconds and bytes) to ``<out_dir>/rank<r>.json``.

Usage: ``offload_worker.py OUT_DIR SWAP_DIR HIDDEN LAYERS STEPS [--grads nvme|ram] [--fast-init]
[--buffer-count N]``: ``--grads ram`` sets ``offload_gradients: false`` (default nvme: gradients written behind to
the swap file, zero/stage3/grad_offload.py); ``--fast-init`` sets ``offload_optimizer.fast_init``;
``--buffer-count`` fixes ``offload_optimizer.buffer_count`` (default: sized from the measured disk, which makes
host memory depend on the disk's speed at that moment: the memory tests fix it).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import shardspeed


def rss_anon_kib() -> int:
    """Anonymous resident memory (heap, tensors, private mappings) of this process, in KiB."""
    match = re.search(r"^RssAnon:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    assert match is not None, "no RssAnon line in /proc/self/status"
    return int(match.group(1))


class PeakSampler(threading.Thread):
    """Samples RssAnon every millisecond; ``peak_kib`` is the largest value seen (and ``mark``s: the largest
    value seen since each named point, for locating where memory goes)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_kib = rss_anon_kib()
        self.phase = "init"
        self.phase_peaks: dict[str, int] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self._sample()
            time.sleep(0.001)

    def _sample(self) -> None:
        value = rss_anon_kib()
        self.peak_kib = max(self.peak_kib, value)
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), value)

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self._sample()


def _io_counters(engine: shardspeed.DeepSpeedEngine) -> dict[str, float]:
    """Cumulative figures of the offload machinery: the optimizer stream's waits and Adam time, and each swap
    file's I/O (seconds summed over its threads, bytes)."""
    streamed = engine.optimizer
    out = {
        "opt_wait_read_s": streamed.timings.wait_read_s,
        "opt_adam_s": streamed.timings.adam_s,
        "opt_wait_write_s": streamed.timings.wait_write_s,
    }
    offloader = engine.states.param_offloader
    stores = {"opt": streamed.store, "params": offloader.store if offloader is not None else None}
    for name, store in stores.items():
        stats = getattr(store, "stats", None)
        if stats is None:
            continue
        out[f"{name}_io_read_s"], out[f"{name}_io_write_s"] = stats.read_s, stats.write_s
        out[f"{name}_read_bytes"], out[f"{name}_write_bytes"] = stats.read_bytes, stats.write_bytes
    return out


def build_model(hidden: int, layers: int) -> torch.nn.Module:
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        # plain nn.Linear: F.linear saves a view of the gathered weight; the ZeRO-3 runtime's saved-tensor hooks
        # keep that view from pinning released units (see [Note: saved views])
        blocks += [torch.nn.Linear(hidden, hidden), torch.nn.Tanh()]
    return torch.nn.Sequential(*blocks)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("out_dir", "swap_dir"):
        parser.add_argument(name)
    for name in ("hidden", "layers", "steps"):
        parser.add_argument(name, type=int)
    parser.add_argument("--grads", choices=("nvme", "ram"), default="nvme")
    parser.add_argument("--fast-init", action="store_true")
    parser.add_argument("--buffer-count", type=int, default=None)
    args = parser.parse_args()
    out_dir, swap_dir, hidden, layers, steps = Path(args.out_dir), args.swap_dir, args.hidden, args.layers, args.steps
    optimizer_offload = {
        "device": "nvme",
        "nvme_path": swap_dir,
        "offload_gradients": args.grads == "nvme",
        "fast_init": args.fast_init,
    }
    if args.buffer_count is not None:
        optimizer_offload["buffer_count"] = args.buffer_count
    # torch imports its optimizer machinery (dynamo and friends, ~70 MB) on the first optimizer it builds: an
    # import cost, not training memory, so it happens before the baseline.
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    gc.collect()
    baseline_kib = rss_anon_kib()
    sampler = PeakSampler()
    sampler.start()
    torch.manual_seed(0)
    with shardspeed.zero.Init():
        model = build_model(hidden, layers)
    params = sum(p.numel() for p in model.parameters())
    unit = hidden * hidden + hidden  # one Linear: ZeRO-3's unit here
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "stage3_prefetch_bucket_size": unit,
            "stage3_max_live_parameters": 2 * unit,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "sub_group_size": 1 << 20,
            "offload_param": {"device": "nvme", "nvme_path": swap_dir, "max_in_cpu": 0},  # every shard to NVMe
            "offload_optimizer": optimizer_offload,
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 2},
        "steps_per_print": 1000,
    }
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = engine.topology.global_rank
    sampler.phase = "ready"
    generator = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(4, hidden, generator=generator)
    y = torch.tanh(x.flip(1))  # a fixed, learnable target
    losses, step_seconds, breakdown = [], [], []
    for step in range(steps):
        before = _io_counters(engine)
        start = time.perf_counter()
        sampler.phase = f"forward{step}"
        loss = F.mse_loss(engine(x), y)
        forward = time.perf_counter()
        sampler.phase = f"backward{step}"
        engine.backward(loss)
        backward = time.perf_counter()
        sampler.phase = f"optimizer{step}"
        engine.step()
        end = time.perf_counter()
        step_seconds.append(end - start)
        losses.append(loss.item())
        after = _io_counters(engine)
        parts = {"forward_s": forward - start, "backward_s": backward - forward, "optimizer_s": end - backward}
        parts.update({key: after[key] - before[key] for key in after})
        breakdown.append(parts)
    sampler.phase = "end"
    sink = engine.states.grad_sink
    streamed = engine.optimizer
    setup = {
        "grads_on_nvme": sink is not None,
        "grad_peak_bytes": sink.peak_bytes if sink is not None else None,
        "grad_window_bytes": streamed.grad_swap.window_bytes if streamed.grad_swap is not None else None,
        "buffer_sets": streamed.pipeline.buffer_sets,
        "read_ahead": streamed.pipeline.read_ahead,
    }
    engine.destroy()
    sampler.stop()
    report = {
        "params": params,
        "baseline_kib": baseline_kib,
        "peak_kib": sampler.peak_kib,
        # training only (forward / backward / optimizer of every step); construction is phase "init" (each unit's
        # shard goes to the swap file as it is materialized: [Note: offload during construction])
        "train_peak_kib": max(v for k, v in sampler.phase_peaks.items() if k not in ("init", "ready", "end")),
        "phase_peaks_kib": sampler.phase_peaks,
        "losses": losses,
        "step_seconds": step_seconds,
        "breakdown": breakdown,
        "setup": setup,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
