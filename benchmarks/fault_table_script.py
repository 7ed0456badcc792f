"""The training script every fault-table row launches (``benchmarks/fault_table.py`` writes its spec).

    shardspeed --num_procs 2 fault_table_script.py --spec ROW/spec.json --rundir RUNDIR [--resume]
    python fault_table_script.py --spec ROW/spec.json --verify CKPT_DIR      (a fresh world of one)

A tiny deterministic MLP trained with Adam for ``steps`` steps, ZeRO stage and precision from the spec, a
checkpoint every ``save_every`` steps into the spec's checkpoint directory (tags ``step2``, ``step4``, ...). The
batch of step ``s`` on rank ``r`` is a pure function of ``(s, r)``, so a run resumed from step ``s`` sees exactly
the data the uninterrupted run saw; the model has no dropout, so the only other state is in the checkpoint.

The spec's ``fault`` (``point``, ``kind``, ``rank``, ``step``) is injected on that rank at that step, *inside* the
engine call it names, through public hooks only (nothing in shardspeed is patched):

=============  =====================================================================================
point          how
=============  =====================================================================================
initialize     the client ``lr_scheduler`` factory, which ``initialize`` calls, raises
forward        a forward pre-hook on the model (``caught``: the loop catches it and skips the batch)
backward       a gradient hook on the loss, run by autograd inside ``engine.backward``
step           the client LR scheduler's ``step()``, run inside ``engine.step``
save           ``raise``: a ``client_state`` that is not plain data; ``kill``: a ``state_dict`` post-hook,
               which ``save_checkpoint`` runs on data-parallel rank 0 after writing its tensors
load           at that step every rank reloads the latest checkpoint; a ``state_dict`` post-hook raises on one
user           the loop itself raises after ``engine.step`` (an exception in the user's code)
mismatch       that rank alone calls ``save_checkpoint`` (the others go on training): diverging collectives
nan            NaN in that rank's batch
fp16_storm     the loss times 1e30 on that rank from that step on (fp16 overflow every step)
inject         sets ``SHARDSPEED_INJECT`` to ``fault.inject`` at that step (ENOSPC at the write layer)
preempt        slow steps from that step on, so the harness's SIGTERM to the launcher lands mid-run
resume_load    the damaged-checkpoint rows: the marker is written just before ``--resume`` loads
=============  =====================================================================================

``kind`` is ``raise`` (a RuntimeError naming the rank and step) or ``kill`` (SIGKILL of this process). Just before
injecting, the rank writes ``RUNDIR/fault.json`` (wall-clock time, rank, step, what): the harness measures the
time to exit from it, and a row whose marker is missing reports that the fault never fired.

At the end rank 0 writes ``RUNDIR/final.pt`` (the full module state dict, gathered at ZeRO-3) and ``done.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

IN_FEATURES, HIDDEN, OUT_FEATURES, MICRO_BATCH = 16, 32, 4, 4


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(x))
        h = torch.nn.functional.gelu(self.fc2(h))
        return torch.nn.functional.mse_loss(self.head(h), y.to(h.dtype))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch of 1-based ``step`` on ``rank``: depends on nothing else (resume sees the same data)."""
    generator = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(MICRO_BATCH, IN_FEATURES, generator=generator), torch.randn(
        MICRO_BATCH, OUT_FEATURES, generator=generator
    )


def build_config(spec: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed-style config of a row (the harness's ``Row.config`` is merged over these defaults)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": spec["stage"]},
        "steps_per_print": 10_000,
    }
    if spec.get("precision") == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 4, "hysteresis": 1, "min_loss_scale": 1}
    elif spec.get("precision") == "bf16":
        config["bf16"] = {"enabled": True}
    return _merge(config, spec.get("config", {}))


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class Fault:
    """This rank's view of the spec's fault: whether it fires at a point and step, and the marker it leaves."""

    def __init__(self, spec: dict[str, Any] | None, rank: int, run_dir: Path | None) -> None:
        self.spec = spec or {}
        self.rank = rank
        self.run_dir = run_dir
        self.step = 0  # the 1-based step the loop is in
        self.armed_point: str | None = None  # set around the engine call a state_dict hook must fire in

    def due(self, point: str, step: int | None = None) -> bool:
        spec = self.spec
        if not spec or spec.get("point") != point or spec.get("rank", self.rank) != self.rank:
            return False
        return spec.get("step") is None or spec["step"] == (self.step if step is None else step)

    def mark(self, what: str) -> None:
        """Record the moment of the fault (before it happens: a killed process writes nothing afterwards)."""
        line = f"[fault_table] rank {self.rank}: injecting {what} at step {self.step}"
        print(line, flush=True)
        if self.run_dir is not None and not (self.run_dir / "fault.json").exists():
            record = {"time": time.time(), "rank": self.rank, "step": self.step, "what": what}
            (self.run_dir / "fault.json").write_text(json.dumps(record))

    def fire(self, where: str) -> None:
        """Raise or die here, as the spec's ``kind`` says."""
        kind = self.spec.get("kind", "raise")
        self.mark(f"{kind} in {where}")
        if kind == "kill":
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"fault_table: injected exception in {where} on rank {self.rank} at step {self.step}")


class HookLR:
    """A constant client LR scheduler whose ``step()`` (run inside ``engine.step``) can carry the fault."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        if self.fault.due("step"):
            self.fault.fire("engine.step (the LR scheduler's step)")

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = int(state["steps"])

    def get_last_lr(self) -> list[float]:
        return [1e-2]


def _state_dict_hook(fault: Fault):
    def hook(_module: nn.Module, _state: dict, _prefix: str, _local: dict) -> None:
        if fault.armed_point is not None and fault.due(fault.armed_point):
            fault.fire(f"engine.{fault.armed_point}_checkpoint (a state_dict hook)")

    return hook


def _forward_pre_hook(fault: Fault):
    def hook(_module: nn.Module, _inputs: tuple) -> None:
        if fault.due("forward"):
            fault.fire("engine forward (a forward pre-hook)")

    return hook


def _write_json(path: Path, record: dict[str, Any]) -> None:
    path.write_text(json.dumps(record))


def train(args: argparse.Namespace, spec: dict[str, Any]) -> int:
    import shardspeed as deepspeed

    rank = int(os.environ.get("RANK", "0"))
    run_dir = Path(args.rundir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fault = Fault(spec.get("fault"), rank, run_dir)
    ckpt = Path(spec["checkpoint_dir"])
    config = build_config(spec)
    if fault.due("inject", step=0):  # before initialize: e.g. ENOSPC while the swap files are set up
        fault.mark(f"SHARDSPEED_INJECT={fault.spec['inject']} before initialize")
        os.environ["SHARDSPEED_INJECT"] = fault.spec["inject"]

    def scheduler_factory(_optimizer: torch.optim.Optimizer) -> HookLR:
        if fault.due("initialize", step=0):
            fault.fire("initialize (the client lr_scheduler factory)")
        return HookLR(fault)

    torch.manual_seed(1234)
    model = TinyMLP()
    model.register_forward_pre_hook(_forward_pre_hook(fault))
    model.register_state_dict_post_hook(_state_dict_hook(fault))
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, lr_scheduler=scheduler_factory)
    input_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(spec.get("precision", "fp32"), torch.float32)
    start = 0
    if args.resume:
        if fault.due("resume_load", step=0):
            fault.mark("a damaged checkpoint, loaded by --resume")
        path, client = engine.load_checkpoint(str(ckpt))
        start = int((client or {}).get("step", 0)) if path is not None else 0
    elif config.get("fault_tolerance", {}).get("auto_resume"):
        start = int(engine.global_steps)  # auto_resume loaded (or not) inside initialize
    if rank == 0:
        _write_json(run_dir / "start.json", {"start_step": start, "global_steps": int(engine.global_steps)})
    print(f"[fault_table] rank {rank}: training steps {start + 1}..{spec['steps']}", flush=True)
    for index in range(start, spec["steps"]):
        step = fault.step = index + 1
        x, y = batch(step, rank)
        x = x.to(input_dtype)  # the engine casts the model, not its inputs (as DeepSpeed)
        if fault.due("nan"):
            fault.mark("NaN in the input batch")
            x[0, 0] = float("nan")
        if fault.due("preempt"):
            fault.mark("slow steps (waiting for SIGTERM to the launcher)")
        if fault.spec.get("point") == "preempt" and step >= fault.spec["step"]:
            time.sleep(spec.get("slow_step_s", 1.0))
        if fault.due("inject"):
            fault.mark(f"SHARDSPEED_INJECT={fault.spec['inject']}")
            os.environ["SHARDSPEED_INJECT"] = fault.spec["inject"]
        if fault.spec.get("point") == "load" and step == fault.spec.get("step"):  # every rank loads; one fails
            fault.armed_point = "load"
            engine.load_checkpoint(str(ckpt))
            fault.armed_point = None
        try:
            loss = engine(x, y)
        except RuntimeError:
            if fault.spec.get("kind") != "caught":
                raise
            print(f"[fault_table] rank {rank}: forward raised at step {step}; skipping the batch", flush=True)
            continue
        storm = fault.spec.get("point") == "fp16_storm" and fault.spec.get("rank", rank) == rank
        if storm and step >= fault.spec["step"]:
            if fault.due("fp16_storm"):
                fault.mark("loss x 1e30 from this step on")
            loss = loss * 1e30
        if fault.due("backward"):
            loss.register_hook(lambda grad: fault.fire("engine.backward (a gradient hook on the loss)"))
        engine.backward(loss)
        engine.step()
        if fault.due("user"):
            fault.fire("the user's loop, between engine calls")
        if fault.due("mismatch"):
            fault.mark("save_checkpoint on this rank only")
            engine.save_checkpoint(str(ckpt), tag=f"rank{rank}_only")
        if step % spec.get("save_every", 2) == 0:
            client_state: dict[str, Any] = {"step": step}
            if fault.due("save") and fault.spec.get("kind", "raise") == "raise":
                fault.mark("raise in engine.save_checkpoint (client_state is not plain data)")
                client_state["not_plain_data"] = object()
            fault.armed_point = "save"
            engine.save_checkpoint(str(ckpt), tag=f"step{step}", client_state=client_state)
            fault.armed_point = None
    state = {name: value.detach().float().clone() for name, value in engine.module_state_dict().items()}
    if rank == 0:
        torch.save(state, run_dir / "final.pt")
        finite = all(bool(torch.isfinite(value).all()) for value in state.values())
        _write_json(
            run_dir / "done.json",
            {"global_steps": int(engine.global_steps), "skipped_steps": int(engine.skipped_steps), "finite": finite},
        )
    print(f"[fault_table] rank {rank}: finished at step {spec['steps']}", flush=True)
    return 0


def verify(spec: dict[str, Any], checkpoint_dir: str) -> int:
    """Load the latest checkpoint in a fresh world of one; print one JSON line (``loads``, tag, error)."""
    import shardspeed as deepspeed

    config = build_config(spec)
    config.setdefault("fault_tolerance", {}).pop("auto_resume", None)
    config["fault_tolerance"].pop("save_on_preemption", None)
    result: dict[str, Any] = {"loads": False}
    try:
        torch.manual_seed(1234)
        engine, _, _, _ = deepspeed.initialize(
            model=TinyMLP(), config=config, lr_scheduler=HookLR(Fault(None, 0, None))
        )
        path, client = engine.load_checkpoint(checkpoint_dir)
        if path is None:
            result["error"] = "no latest checkpoint"
        else:
            finite = all(bool(torch.isfinite(p).all()) for p in engine.module_state_dict().values())
            result.update(loads=True, tag=Path(path).name, step=(client or {}).get("step"), finite=finite)
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
    print("FAULT_TABLE_VERIFY " + json.dumps(result), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description="one fault-table row's training script")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--rundir", help="this launch's output directory (fault.json, final.pt, ...)")
    parser.add_argument("--resume", action="store_true", help="load the latest checkpoint before training")
    parser.add_argument("--verify", metavar="CKPT_DIR", help="only load the latest checkpoint (world of one)")
    args = parser.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    if args.verify:
        return verify(spec, args.verify)
    return train(args, spec)


if __name__ == "__main__":
    sys.exit(main())
