"""What the demo shows while and after it trains: one periodic gather of every rank's numbers, rank 0's tqdm
bar, and the final summary table.

Statistics travel in a single small ``all_gather`` every few optimizer steps (not every micro-step): each rank
contributes [loss sum, loss count, resident memory, stop vote], so one collective yields the data-parallel
mean loss, every rank's memory and a stop decision all ranks agree on.
"""

from __future__ import annotations

import math
import resource
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tqdm import tqdm


def read_memory_mb(field_name: str = "VmRSS") -> float:
    """This process's resident memory (``VmRSS``) or its peak (``VmHWM``) in MB, from /proc/self/status.

    Off Linux there is no /proc: the peak falls back to getrusage (KiB on Linux, bytes on macOS), the
    current value to 0.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) / 1024.0  # reported in kB
    except OSError:
        pass
    if field_name == "VmHWM":
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0
    return 0.0


@dataclass(frozen=True)
class GatheredStats:
    """One gather's result, identical on every rank."""

    mean_loss: float  # over all ranks' micro-steps since the previous gather
    memory_mb: list[float]  # per rank, in rank order
    stop: bool  # some rank voted to stop


def gather_stats(
    loss_sum: float,
    loss_count: int,
    memory_mb: float,
    stop_vote: bool,
    *,
    group: dist.ProcessGroup | None,
    world_size: int,
    device: torch.device,
) -> GatheredStats:
    """Collective over ``group`` (every rank must call it at the same point)."""
    mine = torch.tensor([loss_sum, float(loss_count), memory_mb, float(stop_vote)], dtype=torch.float64)
    if world_size == 1:
        rows = mine.unsqueeze(0)
    else:
        # NCCL only moves device tensors; gloo is happy with CPU ones.
        gathered = [torch.empty(4, dtype=torch.float64, device=device) for _ in range(world_size)]
        dist.all_gather(gathered, mine.to(device), group=group)
        rows = torch.stack(gathered).cpu()
    count = rows[:, 1].sum().item()
    mean_loss = rows[:, 0].sum().item() / count if count else math.nan
    return GatheredStats(mean_loss, rows[:, 2].tolist(), bool(rows[:, 3].max().item() > 0))


def format_memory(memory_mb: list[float]) -> str:
    return "mem " + "/".join(f"{mb:.0f}" for mb in memory_mb) + " MB"


def format_rate(tokens_per_second: float) -> str:
    if tokens_per_second >= 1e6:
        return f"{tokens_per_second / 1e6:.2f}M tok/s"
    return f"{tokens_per_second / 1e3:.1f}k tok/s"


class ProgressBar:
    """tqdm on rank 0, nothing elsewhere (so the terminal shows one bar, not one per rank)."""

    def __init__(self, total_steps: int, *, enabled: bool) -> None:
        self._bar = (
            tqdm(total=total_steps, unit="step", dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
            if enabled
            else None
        )

    def update(self, steps: int, *, loss: float, tokens_per_second: float, memory_mb: list[float], lr: float) -> None:
        if self._bar is None:
            return
        self._bar.set_postfix_str(
            f"loss {loss:.3f} | {format_rate(tokens_per_second)} | {format_memory(memory_mb)} | lr {lr:.2e}",
            refresh=False,
        )
        self._bar.update(steps)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@dataclass
class RunSummary:
    world_size: int
    stage: int
    precision: str
    backend: str
    model_description: str
    steps: int = 0
    first_loss: float = math.nan
    last_loss: float = math.nan
    smoothing_steps: int = 0
    eval_loss_before: float = math.nan
    eval_loss_after: float = math.nan
    tokens_per_second: float = 0.0
    train_seconds: float = 0.0
    wall_seconds: float = 0.0
    peak_memory_mb: list[float] = field(default_factory=list)
    stopped_by_time_budget: bool = False
    mfu: str = "n/a"
    """Model FLOPs utilization, as ``observe.mfu_line`` words it."""
    run_dir: str = ""

    @property
    def loss_went_down(self) -> bool:
        return math.isfinite(self.last_loss) and self.last_loss < self.first_loss

    def table(self) -> str:
        steps_note = " (stopped by --time-budget)" if self.stopped_by_time_budget else ""
        rows = [
            ("world size", f"{self.world_size} ({self.backend})"),
            ("ZeRO stage", str(self.stage)),
            ("precision", self.precision),
            ("model", self.model_description),
            ("steps", f"{self.steps}{steps_note}"),
            (
                "train loss",
                f"{self.first_loss:.4f} -> {self.last_loss:.4f} (mean of first / last {self.smoothing_steps} steps)",
            ),
            ("eval loss", f"{self.eval_loss_before:.4f} -> {self.eval_loss_after:.4f} (held-out windows)"),
            ("throughput", f"{format_rate(self.tokens_per_second)} (all ranks)"),
            ("wall time", f"{self.wall_seconds:.1f} s (training loop {self.train_seconds:.1f} s)"),
            ("peak RSS per rank", "/".join(f"{mb:.0f}" for mb in self.peak_memory_mb) + " MB"),
            ("MFU", self.mfu),
            ("run directory", self.run_dir or "-"),
            ("loss went down", "yes" if self.loss_went_down else "NO"),
        ]
        width = max(len(name) for name, _ in rows)
        lines = ["", "shardspeed demo summary", "-" * 60]
        lines += [f"  {name:<{width}}  {value}" for name, value in rows]
        lines.append("-" * 60)
        return "\n".join(lines)
