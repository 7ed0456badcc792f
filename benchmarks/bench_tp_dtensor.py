"""Tensor parallelism, shardspeed against torch DTensor ``parallelize_module``: step time and peak memory.

    python benchmarks/bench_tp_dtensor.py [--tp 2] [--repeats 7] [--steps 5] [--warmup 2] [--model small]
                                          [--memory-repeats 2] [--check-steps 3] [--device cpu|cuda] [--json F]

Both sides train the same GPT-style decoder (``tp_model.py``) from the same dense weights on the same batches,
sliced by the same plan (q, k, v, MLP fc column-parallel; attention o and MLP proj row-parallel; embeddings, norms
and the tied LM head replicated) at TP = ``--tp`` = the world size:
- torch: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on a 1-d ``DeviceMesh`` of the
  tensor ranks, plain ``torch.optim.AdamW``;
- shardspeed: ``ColumnParallelLinear`` / ``RowParallelLinear`` (``load_dense``), trained by a ``ShardSpeedEngine``
  at ZeRO 0 on ``Topology.build(MeshShape(tensor=TP))``, AdamW from the config.

Run plainly, this script is the launcher: it starts itself under ``torch.distributed.run`` once for timing and
once per side and memory repeat, then prints the table.

Timing (one set of processes holding both sides): first ``--check-steps`` steps of each side from the fresh
weights, whose losses are compared (with each other and with a single-process dense AdamW reference), then
``--warmup`` untimed steps, then ``--repeats`` rounds; each round times ``--steps`` steps of each side back to back
(barrier-synchronized, slowest rank), the order alternating per round so drift does not favour one side.

Memory: CPU ``VmHWM`` (the kernel's per-process peak RSS) cannot be reset, and tracemalloc does not see tensor
storage (torch allocates it outside Python's allocator), so each side's peak comes from a fresh torchrun that
builds only that side, alternating sides over ``--memory-repeats``. The figure is the growth of VmHWM over its
value just before the side was built (after imports, the process groups and the dense template): the side's model
slice, gradients, AdamW state, communication buffers and activations. On CUDA the same processes also report
``torch.cuda.max_memory_allocated`` (reset before the build), which counts tensors only.

``--device cuda`` (nccl, one GPU per rank by LOCAL_RANK) is written but has not been run (no GPU here).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_rows import ADAMW_PARAMS
from bench_tp_report import SIDES, format_report
from launch_util import child_env, free_port
from proc_status import read_status_mib
from stats import median
from tp_model import TP_MODEL_SIZES, TPModelSize, build_dense, make_batches, parallelize_for_torch, slice_for_shardspeed

BATCH_COUNT = 4  # steps cycle through these; distinct batches make the loss check more than one repeated sample


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size = ranks (default 2)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds, sides alternating (default 7)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side per round (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side after the check (default 2)")
    parser.add_argument("--check-steps", type=int, default=3, help="steps whose losses are compared (default 3)")
    parser.add_argument(
        "--memory-repeats", type=int, default=2, help="fresh processes per side (default 2; 0 skips memory)"
    )
    parser.add_argument("--model", choices=sorted(TP_MODEL_SIZES), default="small", help="model size (default small)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu/gloo or cuda/nccl (untested)")
    parser.add_argument("--json", default=None, help="also write the raw results to this file")
    # Internal: how the launcher tells its torchrun children what to do.
    parser.add_argument("--memory-side", choices=SIDES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("tp", "repeats", "steps", "check_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("warmup", "memory_repeats"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    try:
        TP_MODEL_SIZES[args.model].check_tensor_parallel(args.tp)
    except ValueError as error:
        parser.error(f"--model {args.model} at --tp {args.tp}: {error}")
    return args


# --- ranks (under torchrun) ------------------------------------------------------------------------------
@dataclass
class Side:
    """One way to train the model, in two phases: ``forward_backward(tokens, targets) -> loss`` and
    ``optimizer_step()``. ``step()`` runs both on the next batch and returns the loss."""

    name: str
    forward_backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer_step: Callable[[], None]
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    local_elements: int  # parameter elements this rank holds (tied weights once): shows the slicing happened
    taken: int = 0

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batches[self.taken % len(self.batches)]
        self.taken += 1
        return batch

    def step(self) -> float:
        loss = self.forward_backward(*self._next_batch())
        self.optimizer_step()
        return float(loss)

    def timed_phases(self, device: torch.device) -> tuple[float, float]:
        """One step, returning (seconds in forward + backward, seconds in the optimizer step) on this rank."""
        batch = self._next_batch()
        _synchronize(device)
        started = time.perf_counter()
        self.forward_backward(*batch)
        _synchronize(device)
        between = time.perf_counter()
        self.optimizer_step()
        _synchronize(device)
        return between - started, time.perf_counter() - between


def local_elements(model: torch.nn.Module) -> int:
    """Elements of the parameters this rank stores (a DTensor counts its local shard)."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def _torch_side(name: str, model: torch.nn.Module, batches: list[Any]) -> Side:
    """The plain torch loop (``set_to_none`` is torch's default for ``zero_grad``)."""
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW_PARAMS)

    def forward_backward(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = model(tokens, targets)
        loss.backward()
        return loss.detach()

    def optimizer_step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Side(name, forward_backward, optimizer_step, batches, local_elements(model))


def build_torch_side(template: torch.nn.Module, device: torch.device, batches: list[Any]) -> Side:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tensor",))
    return _torch_side("torch", parallelize_for_torch(copy.deepcopy(template).to(device), mesh), batches)


def shardspeed_config(size: TPModelSize) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": size.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {**ADAMW_PARAMS, "betas": list(ADAMW_PARAMS["betas"])}},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
    }


def build_shardspeed_side(template: torch.nn.Module, device: torch.device, batches: list[Any]) -> Side:
    from shardspeed.config import load_config
    from shardspeed.engine import ShardSpeedEngine
    from shardspeed.tensor_parallel import TensorParallel
    from shardspeed.topology import MeshShape, Topology

    topology = Topology.build(MeshShape(tensor=dist.get_world_size()))
    model = slice_for_shardspeed(copy.deepcopy(template).to(device), TensorParallel.from_topology(topology))
    engine = ShardSpeedEngine(model, load_config(shardspeed_config(template.size), dp_world_size=1), topology)

    def forward_backward(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = engine(tokens, targets)
        engine.backward(loss)
        return loss.detach()

    return Side("shardspeed", forward_backward, engine.step, batches, local_elements(model))


BUILDERS = {"torch": build_torch_side, "shardspeed": build_shardspeed_side}


def dense_reference_losses(template: torch.nn.Module, batches: list[Any], steps: int) -> list[float]:
    """The single-process dense model trained by torch AdamW: what both sliced sides must reproduce."""
    side = _torch_side("dense", copy.deepcopy(template), batches)
    return [side.step() for _ in range(steps)]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_block(side: Side, steps: int, device: torch.device) -> float:
    """Mean ms per step over ``steps`` steps between two barriers, on the slowest rank."""
    _synchronize(device)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        side.step()
    _synchronize(device)
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item()) * 1000.0 / steps


def phase_split(sides: dict[str, Side], steps: int, device: torch.device) -> dict[str, list[float]]:
    """[forward + backward ms, optimizer ms] per side: the median over ``steps`` steps (sides alternating step
    by step) on each rank, then the slowest rank. Untimed by the rounds: it runs after them."""
    phases: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for _ in range(steps):
        for name, side in sides.items():
            phases[name].append(side.timed_phases(device))
    result = {}
    for name, taken in phases.items():
        mine = [median([t[0] for t in taken]) * 1000.0, median([t[1] for t in taken]) * 1000.0]
        slowest = torch.tensor(mine, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        result[name] = slowest.tolist()
    return result


def timing_run(args: argparse.Namespace, template: torch.nn.Module, device: torch.device) -> dict[str, Any]:
    batches = [(x.to(device), y.to(device)) for x, y in make_batches(template.size, BATCH_COUNT)]
    reference = dense_reference_losses(template, [(x.cpu(), y.cpu()) for x, y in batches], args.check_steps)
    sides = {name: BUILDERS[name](template, device, batches) for name in SIDES}
    check = {name: [side.step() for _ in range(args.check_steps)] for name, side in sides.items()}
    for side in sides.values():
        for _ in range(args.warmup):
            side.step()
    step_ms: dict[str, list[float]] = {name: [] for name in SIDES}
    for round_index in range(args.repeats):
        order = SIDES if round_index % 2 == 0 else SIDES[::-1]
        for name in order:
            step_ms[name].append(time_block(sides[name], args.steps, device))
        if dist.get_rank() == 0:
            done = ", ".join(f"{name} {step_ms[name][-1]:.1f} ms" for name in order)
            print(f"round {round_index + 1}/{args.repeats} ({' then '.join(order)}): {done}", flush=True)
    return {
        "step_ms": step_ms,
        "phase_ms": phase_split(sides, args.steps, device),
        "check_losses": {**check, "dense": reference},
        "local_elements": {name: side.local_elements for name, side in sides.items()},
        "model": template.size.describe(),
        "parameters": sum(p.numel() for p in template.parameters()),
        "world": dist.get_world_size(),
        "threads": torch.get_num_threads(),
        "device": device.type,
        "backend": dist.get_backend(),
    }


def _trigger_one_time_setup(device: torch.device) -> None:
    """Pay torch's lazy one-time costs (optimizer imports, autograd threads) before the baseline, alike for
    both sides, so the growth is about the side's own tensors."""
    weight = torch.nn.Parameter(torch.zeros(1, device=device))
    optimizer = torch.optim.AdamW([weight])
    (weight * 2.0).sum().backward()
    optimizer.step()


def memory_run(args: argparse.Namespace, template: torch.nn.Module, device: torch.device) -> dict[str, Any]:
    import torch.distributed.tensor.parallel  # both sides' libraries are imported in every memory process

    import shardspeed.engine  # noqa: F401

    batches = [(x.to(device), y.to(device)) for x, y in make_batches(template.size, BATCH_COUNT)]
    _trigger_one_time_setup(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    baseline = read_status_mib("VmHWM")
    side = BUILDERS[args.memory_side](template, device, batches)
    for _ in range(args.check_steps + args.warmup + args.steps):
        side.step()
    _synchronize(device)
    mine = {"baseline_mib": baseline, "peak_mib": read_status_mib("VmHWM")}
    if device.type == "cuda":
        mine["cuda_peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {"side": args.memory_side, "ranks": gathered}


def rank_main(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(backend)
    succeeded = False
    try:
        template = build_dense(TP_MODEL_SIZES[args.model])
        if args.memory_side is not None:
            result = memory_run(args, template, device)
        else:
            result = timing_run(args, template, device)
        if dist.get_rank() == 0 and args.result_file:
            Path(args.result_file).write_text(json.dumps(result))
        succeeded = True
    finally:
        gc.collect()  # engines and DTensor states hold reference cycles: free them while the group exists
        if succeeded:  # after a failure the other ranks may never reach it: a barrier would hang
            dist.barrier()
        dist.destroy_process_group()


# --- launcher (no RANK in the environment) ---------------------------------------------------------------
def _torchrun(args: argparse.Namespace, result_file: Path, memory_side: str | None) -> dict[str, Any]:
    forwarded = [
        *("--tp", str(args.tp), "--repeats", str(args.repeats), "--steps", str(args.steps)),
        *("--warmup", str(args.warmup), "--check-steps", str(args.check_steps), "--model", args.model),
        *("--device", args.device, "--result-file", str(result_file)),
        *(("--memory-side", memory_side) if memory_side else ()),
    ]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.tp)]
    command += ["--master_port", str(free_port()), str(Path(__file__).resolve()), *forwarded]
    completed = subprocess.run(command, env=child_env(cpu_only=args.device == "cpu"), check=False)
    if completed.returncode != 0:
        what = f"memory run of the {memory_side} side" if memory_side else "timing run"
        raise SystemExit(f"bench_tp_dtensor: the {what} failed (exit code {completed.returncode}); see above")
    return json.loads(result_file.read_text())


def launcher_main(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_tp_") as scratch:
        timing = _torchrun(args, Path(scratch) / "timing.json", None)
        memory: dict[str, list[dict[str, Any]]] = {name: [] for name in SIDES}
        for repeat in range(args.memory_repeats):
            for name in SIDES if repeat % 2 == 0 else SIDES[::-1]:
                memory[name].append(_torchrun(args, Path(scratch) / f"memory_{name}_{repeat}.json", name))
    print()
    print(format_report(args, timing, memory))
    print(f"\n(total wall time {time.perf_counter() - started:.0f} s on {os.cpu_count()} CPUs)")
    if args.json:
        Path(args.json).write_text(json.dumps({"timing": timing, "memory": memory}, indent=1))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if "RANK" in os.environ:
        rank_main(args)
    else:
        launcher_main(args)


if __name__ == "__main__":
    main()
