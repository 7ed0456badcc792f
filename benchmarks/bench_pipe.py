"""Pipeline parallelism (PP=2), shardspeed against torch.distributed.pipelining and DeepSpeed: step time, bubble,
p2p time, peak memory.

    python benchmarks/bench_pipe.py [--micro-batches 4 8] [--repeats 5] [--steps 3] [--warmup 1]
                                    [--model small] [--memory-repeats 1] [--deepspeed-python PATH] [--json F]

Every side trains the same GPT (``tests/dist/pipe_models.py``, untied head so torch's stages need no tie: token
embedding, positions, identical pre-LN blocks, final norm, head) split in two stages at the middle block (layers
``[0, 2 + blocks/2)`` on stage 0), on world 2 (gloo, CPU), with ``m`` micro-batches of ``micro_batch`` rows per
step and AdamW; every layer is built after ``manual_seed(1234 + its index)`` (``seed_layers``), so all sides start
from the same weights and their first losses are printed side by side (they must agree):
- shardspeed: ``PipelineModule(partition_method="type:Block")`` + ``initialize`` + ``train_batch``, schedules
  ``1f1b`` and ``gpipe`` (``pipeline.schedule``), ZeRO 0;
- torch: ``PipelineStage`` over each rank's ``nn.Sequential`` of the same layers + ``Schedule1F1B`` /
  ``ScheduleGPipe`` (``scale_grads``: the mean over micro-batches), ``torch.optim.AdamW``;
- DeepSpeed 0.19.8 (its ``TrainSchedule`` is 1F1B): ``deepspeed.pipe.PipelineModule`` with the same layers,
  ``partition_method="type:Block"``, ``deepspeed.initialize`` + ``train_batch``, run by
  ``deepspeed_pipe_worker.py`` under a separate venv (DeepSpeed pins its own requirements)::

      python3 -m venv /work/dsvenv && /work/dsvenv/bin/pip install torch==2.13.0 \\
          && DS_BUILD_OPS=0 /work/dsvenv/bin/pip install deepspeed==0.19.8 -c <(echo torch==2.13.0)

  found via ``--deepspeed-python /work/dsvenv/bin/python`` or ``$SHARDSPEED_DEEPSPEED_PYTHON`` (run with
  ``DS_ACCELERATOR=cpu``); without it the rows say "DeepSpeed: not installed".

Figures (per step, the slowest rank unless said otherwise):
- step time: median over ``--repeats`` rounds of the mean of ``--steps`` steps (IQR as spread); shardspeed and
  torch alternate inside one set of processes, so their ratios are per round (stats.py); DeepSpeed runs in its
  own processes and is compared by medians;
- bubble: the measured idle fraction, Σ over stages of time blocked waiting for a p2p message / (stages × step
  time). shardspeed: ``engine.pipe_stats.wait_s`` (the channel's time blocked in receive/send waits). torch exposes
  no such counter: this bench wraps ``torch.distributed.pipelining.schedules._wait_batch_p2p`` (every schedule
  waits its p2p requests there) with a clock — benchmark instrumentation, not library code. DeepSpeed: its p2p is
  blocking ``p2p.send`` / ``p2p.recv``, wrapped the same way (so its figure also holds the transfer itself);
- p2p time: time posting sends/receives (shardspeed ``pipe_stats.post_s``; torch ``_batch_p2p``), apart from the
  idle time; the theoretical bubble (p−1)/(m+p−1) is printed beside the measured one;
- peak memory: growth of VmHWM (peak RSS) from just before the side is built to after its steps, in a fresh
  process per side (``--memory-repeats``), at the largest m.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests" / "dist"))  # pipe_models: torch-only at import

from bench_pipe_report import SIDES  # noqa: E402
from launch_util import child_env, free_port  # noqa: E402
from pipe_models import BASE_SEED, gpt_loss_fn, layer_plan, make_batches, rank_iterator  # noqa: E402
from proc_status import read_status_mib  # noqa: E402

ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
BATCH_COUNT = 4  # distinct global batches, cycled


@dataclass(frozen=True)
class BenchSize:
    vocab: int
    dim: int
    n_blocks: int
    seq: int
    micro_batch: int
    heads: int = 4

    @property
    def ffn(self) -> int:
        return 4 * self.dim

    def plan(self) -> list[Any]:
        return layer_plan(self.vocab, self.dim, self.n_blocks, self.seq, tied=False, heads=self.heads, ffn=self.ffn)

    def split(self) -> list[int]:
        """Layer boundaries of the two stages: the middle block."""
        n_layers = self.n_blocks + 4
        return [0, 2 + self.n_blocks // 2, n_layers]

    def describe(self) -> str:
        return (
            f"vocab {self.vocab}, dim {self.dim}, {self.n_blocks} blocks, seq {self.seq}, "
            f"micro-batch {self.micro_batch}"
        )


SIZES = {
    "tiny": BenchSize(vocab=64, dim=32, n_blocks=4, seq=8, micro_batch=2),
    "small": BenchSize(vocab=256, dim=128, n_blocks=8, seq=64, micro_batch=4),
}


def theoretical_bubble(stages: int, micro_batches: int) -> float:
    return (stages - 1) / (micro_batches + stages - 1)


# --- measuring ---------------------------------------------------------------------------------------------------
@dataclass
class WaitClock:
    """Seconds spent inside wrapped functions (blocked waits, postings), reset per step."""

    seconds: float = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return timed

    def take(self) -> float:
        taken, self.seconds = self.seconds, 0.0
        return taken


@dataclass
class StepFigures:
    """One rank's figures for one step."""

    wall_s: float
    wait_s: float
    post_s: float


@dataclass
class Side:
    name: str
    run_step: Callable[[], float]  # one optimizer step over m micro-batches; returns the loss (last stage)
    figures: Callable[[float], StepFigures]  # the step's wall time → its figures
    first_losses: list[float] = field(default_factory=list)

    def step(self) -> StepFigures:
        started = time.perf_counter()
        loss = self.run_step()
        wall = time.perf_counter() - started
        if len(self.first_losses) < 2:
            self.first_losses.append(loss)
        return self.figures(wall)


def build_stage_layers(size: BenchSize, stage: int) -> torch.nn.Sequential:
    """This stage's layers, each built after ``manual_seed(BASE_SEED + global index)`` (``seed_layers``)."""
    lo, hi = size.split()[stage], size.split()[stage + 1]
    layers = []
    for idx, plan in enumerate(size.plan()):
        if lo <= idx < hi:
            torch.manual_seed(BASE_SEED + idx)
            layers.append(plan.build())
    return torch.nn.Sequential(*layers)


def cycled(size: BenchSize, micro_batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    batches = make_batches(BATCH_COUNT, micro_batches, size.micro_batch, vocab=size.vocab, seq=size.seq)
    while True:
        yield from rank_iterator(batches, micro_batches, 0, 1)


def build_torch_side(size: BenchSize, micro_batches: int, schedule: str, clocks: dict[str, WaitClock]) -> Side:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    module = build_stage_layers(size, rank)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    pipe = kind(stage, n_microbatches=micro_batches, loss_fn=gpt_loss_fn)
    optimizer = torch.optim.AdamW(module.parameters(), **ADAMW)
    data = cycled(size, micro_batches)

    def run_step() -> float:
        chunks = [next(data) for _ in range(micro_batches)]
        tokens = torch.cat([t for t, _ in chunks])
        labels = torch.cat([lab for _, lab in chunks])
        losses: list[torch.Tensor] = []
        if rank == 0:
            pipe.step(tokens)
        else:
            pipe.step(target=labels, losses=losses)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) if losses else float("nan")

    def figures(wall: float) -> StepFigures:
        return StepFigures(wall, clocks["wait"].take(), clocks["post"].take())

    return Side(f"torch-{schedule}", run_step, figures)


def shardspeed_config(size: BenchSize, micro_batches: int, schedule: str) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": size.micro_batch,
        "gradient_accumulation_steps": micro_batches,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
        "zero_optimization": {"stage": 0},
        "pipeline": {"schedule": schedule},
        "steps_per_print": 10**9,
    }


def build_shardspeed_side(size: BenchSize, micro_batches: int, schedule: str) -> Side:
    import shardspeed
    from shardspeed.pipe import LayerSpec, PipelineModule

    specs = [LayerSpec(p.cls, *p.args) for p in size.plan()]
    module = PipelineModule(
        specs, num_stages=2, loss_fn=gpt_loss_fn, seed_layers=True, base_seed=BASE_SEED, partition_method="type:Block"
    )
    if list(module.parts) != size.split():
        raise RuntimeError(f"shardspeed partitioned the layers as {module.parts}, the bench expects {size.split()}")
    engine, *_ = shardspeed.initialize(model=module, config=shardspeed_config(size, micro_batches, schedule))
    data = cycled(size, micro_batches)

    def run_step() -> float:
        return float(engine.train_batch(data))

    def figures(wall: float) -> StepFigures:
        stats = engine.pipe_stats
        return StepFigures(wall, stats.wait_s, stats.post_s)

    return Side(f"shardspeed-{schedule}", run_step, figures)


def build_side(name: str, size: BenchSize, micro_batches: int, clocks: dict[str, WaitClock]) -> Side:
    framework, schedule = name.split("-")
    if framework == "torch":
        return build_torch_side(size, micro_batches, schedule, clocks)
    return build_shardspeed_side(size, micro_batches, schedule)


def install_torch_clocks() -> dict[str, WaitClock]:
    """Clock torch's p2p waits and postings (torch.distributed.pipelining exposes no counter; docstring)."""
    from torch.distributed.pipelining import schedules

    clocks = {"wait": WaitClock(), "post": WaitClock()}
    schedules._wait_batch_p2p = clocks["wait"].wrap(schedules._wait_batch_p2p)
    schedules._batch_p2p = clocks["post"].wrap(schedules._batch_p2p)
    return clocks


def slowest(values: list[float]) -> list[float]:
    """Each value's maximum over the ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def summed(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def time_round(side: Side, steps: int) -> dict[str, float]:
    """One round: ``steps`` steps between barriers. step_ms: the slowest rank's mean; bubble: Σ_stages wait /
    (stages × wall); wait/post ms: the mean over the stages, per step."""
    dist.barrier()
    taken = [side.step() for _ in range(steps)]
    dist.barrier()
    wall = sum(f.wall_s for f in taken) / steps
    wait = sum(f.wait_s for f in taken) / steps
    post = sum(f.post_s for f in taken) / steps
    (wall_max,) = slowest([wall])
    wall_sum, wait_sum, post_sum = summed([wall, wait, post])
    world = dist.get_world_size()
    return {
        "step_ms": wall_max * 1e3,
        "bubble": wait_sum / wall_sum,
        "wait_ms": wait_sum / world * 1e3,
        "post_ms": post_sum / world * 1e3,
    }


def timing_run(args: argparse.Namespace, size: BenchSize) -> dict[str, Any]:
    clocks = install_torch_clocks()
    out: dict[str, Any] = {}
    for m in args.micro_batches:
        sides = {name: build_side(name, size, m, clocks) for name in args.sides}
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in args.sides}
        for side in sides.values():
            for _ in range(max(args.warmup, 2)):  # ≥ 2: the first losses are kept for the check
                side.step()
        for r in range(args.repeats):
            order = args.sides if r % 2 == 0 else args.sides[::-1]
            for name in order:
                rounds[name].append(time_round(sides[name], args.steps))
            if dist.get_rank() == 0:
                done = ", ".join(f"{n} {rounds[n][-1]['step_ms']:.1f} ms" for n in order)
                print(f"m={m} round {r + 1}/{args.repeats}: {done}", flush=True)
        losses = {name: slowest_loss(side.first_losses) for name, side in sides.items()}
        out[str(m)] = {"rounds": rounds, "first_losses": losses}
        del sides
        gc.collect()
    return {"by_m": out, "world": dist.get_world_size(), "model": size.describe()}


def slowest_loss(values: list[float]) -> list[float]:
    """The last stage's losses (the first stage reports nan): gathered from whichever rank has them."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    for losses in gathered[::-1]:
        if losses and all(v == v for v in losses):
            return losses
    return values


def memory_run(args: argparse.Namespace, size: BenchSize) -> dict[str, Any]:
    import torch.distributed.pipelining  # noqa: F401  (both libraries imported before the baseline)

    import shardspeed.pipe  # noqa: F401

    clocks = install_torch_clocks()
    m = max(args.micro_batches)
    baseline = read_status_mib("VmHWM")
    side = build_side(args.memory_side, size, m, clocks)
    for _ in range(args.warmup + args.steps):
        side.step()
    grown = read_status_mib("VmHWM") - baseline
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, grown)
    return {"side": args.memory_side, "growth_mib": gathered, "micro_batches": m}


def rank_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    succeeded = False
    try:
        size = SIZES[args.model]
        result = memory_run(args, size) if args.memory_side else timing_run(args, size)
        if dist.get_rank() == 0 and args.result_file:
            Path(args.result_file).write_text(json.dumps(result))
        succeeded = True
    finally:
        gc.collect()
        if succeeded:
            dist.barrier()
        dist.destroy_process_group()


# --- launcher ----------------------------------------------------------------------------------------------------
def _child_env() -> dict[str, str]:
    return child_env(paths=[REPO_ROOT / "benchmarks", REPO_ROOT / "tests" / "dist"], DS_ACCELERATOR="cpu")


def _torchrun(python: str, script: Path, forwarded: list[str], result_file: Path, what: str) -> dict[str, Any]:
    command = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    command += [str(script), *forwarded, "--result-file", str(result_file)]
    completed = subprocess.run(command, env=_child_env(), check=False)
    if completed.returncode != 0:
        raise SystemExit(f"bench_pipe: the {what} failed (exit code {completed.returncode}); see above")
    return json.loads(result_file.read_text())


def _common_args(args: argparse.Namespace, micro_batches: list[int] | None = None) -> list[str]:
    return [
        *("--repeats", str(args.repeats), "--steps", str(args.steps), "--warmup", str(args.warmup)),
        *("--model", args.model, "--micro-batches", *map(str, micro_batches or args.micro_batches)),
        *("--sides", *args.sides),
    ]


def deepspeed_python(args: argparse.Namespace) -> str | None:
    path = args.deepspeed_python or os.environ.get("SHARDSPEED_DEEPSPEED_PYTHON")
    if not path or not Path(path).exists():
        return None
    probe = subprocess.run([path, "-c", "import deepspeed"], env=_child_env(), capture_output=True, check=False)
    return path if probe.returncode == 0 else None


def launcher_main(args: argparse.Namespace) -> None:
    from bench_pipe_report import format_report

    started = time.perf_counter()
    script = Path(__file__).resolve()
    worker = script.parent / "deepspeed_pipe_worker.py"
    ds_python = deepspeed_python(args)
    with tempfile.TemporaryDirectory(prefix="bench_pipe_") as scratch:
        tmp = Path(scratch)
        timing = _torchrun(sys.executable, script, _common_args(args), tmp / "timing.json", "timing run")
        deepspeed = None
        if ds_python is not None:  # one process per m: each m's peak memory from a fresh process
            deepspeed = {"by_m": {}}
            for m in args.micro_batches:
                forwarded = [*_common_args(args, [m])]
                got = _torchrun(ds_python, worker, forwarded, tmp / f"ds_{m}.json", f"DeepSpeed run (m={m})")
                deepspeed["by_m"].update(got.pop("by_m"))
                deepspeed.update(got)
        memory: dict[str, list[Any]] = {name: [] for name in args.sides}
        for repeat in range(args.memory_repeats):
            for name in args.sides if repeat % 2 == 0 else args.sides[::-1]:
                forwarded = [*_common_args(args), "--memory-side", name]
                memory[name].append(_torchrun(sys.executable, script, forwarded, tmp / f"mem_{name}.json", name))
    report = {"timing": timing, "deepspeed": deepspeed, "memory": memory, "args": vars(args)}
    print()
    print(format_report(report))
    print(f"\n(total wall time {time.perf_counter() - started:.0f} s on {os.cpu_count()} CPUs)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8], help="m values (default 4 8)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds, sides alternating (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="steps per side per round (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side (default 1; at least 2 run)")
    parser.add_argument("--model", choices=sorted(SIZES), default="small", help="model size (default small)")
    parser.add_argument("--memory-repeats", type=int, default=1, help="fresh processes per side (0 skips)")
    parser.add_argument("--deepspeed-python", default=None, help="python of a venv with deepspeed 0.19.8")
    parser.add_argument("--json", default=None, help="also write the raw results to this file")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES), help="rows (default all)")
    parser.add_argument("--memory-side", choices=SIDES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("repeats", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if any(m < 1 for m in args.micro_batches):
        parser.error(f"--micro-batches must be positive, got {args.micro_batches}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if "RANK" in os.environ:
        rank_main(args)
    else:
        launcher_main(args)


if __name__ == "__main__":
    main()
