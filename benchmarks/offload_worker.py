"""One rank of an NVMe-offload run (tests/e2e/test_offload_bounded_memory.py, benchmarks/bench_scale.py; run under
torchrun): trains an fp32 model built under
``shardspeed.zero.Init`` with ZeRO-3 + NVMe parameter and optimizer offload while a thread samples this process's
RssAnon, and writes its baseline (right after imports), peak, losses and step times to ``<out_dir>/rank<r>.json``.

Usage: ``bounded_memory_worker.py OUT_DIR SWAP_DIR HIDDEN LAYERS STEPS``.
"""

from __future__ import annotations

import gc
import json
import re
import sys
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


def build_model(hidden: int, layers: int) -> torch.nn.Module:
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        # plain nn.Linear: F.linear saves a view of the gathered weight; the ZeRO-3 runtime's saved-tensor hooks
        # keep that view from pinning released units (see [Note: saved views])
        blocks += [torch.nn.Linear(hidden, hidden), torch.nn.Tanh()]
    return torch.nn.Sequential(*blocks)


def main() -> None:
    out_dir, swap_dir = Path(sys.argv[1]), sys.argv[2]
    hidden, layers, steps = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
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
            "offload_optimizer": {"device": "nvme", "nvme_path": swap_dir},
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
    losses, step_seconds = [], []
    for step in range(steps):
        start = time.perf_counter()
        sampler.phase = f"forward{step}"
        loss = F.mse_loss(engine(x), y)
        sampler.phase = f"backward{step}"
        engine.backward(loss)
        sampler.phase = f"optimizer{step}"
        engine.step()
        step_seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    sampler.phase = "end"
    engine.destroy()
    sampler.stop()
    report = {
        "params": params,
        "baseline_kib": baseline_kib,
        "peak_kib": sampler.peak_kib,
        "phase_peaks_kib": sampler.phase_peaks,
        "losses": losses,
        "step_seconds": step_seconds,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
