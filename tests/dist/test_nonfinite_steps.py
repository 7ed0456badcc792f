"""Numerical faults ([Note: non-finite steps] in training/nonfinite.py), world 2.

fp32/bf16: a step whose gradients hold NaN/Inf (a NaN in one rank's input, a NaN/Inf loss) is skipped on every
rank — parameters, optimizer states and the LR schedule bitwise unchanged, ``skipped_steps`` and ``global_steps``
advanced as in DeepSpeed — reported once on rank 0 with the step and the first offending parameter in registration
order (agreed across ranks' shards), and ``max_consecutive_nonfinite`` consecutive ones raise on every rank.
fp16: an overflow storm with the loss scale at ``min_loss_scale`` raises after ``min_loss_scale_patience`` steps.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from parity import IN, OUT, global_batches, make_model, rank_slice

import shardspeed
from harness import RankFailure

MB, LR, CLIP = 4, 0.05, 1.0
OPTIMIZER = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}
PRECISIONS = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "bf16_masters": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
}


class Branches(torch.nn.Module):
    """Three independent linear branches summed: with a linear loss, a NaN in branch k's input poisons only
    ``k.weight``'s gradient, so which parameter is "first" is up to the test."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(IN, OUT)
        self.b = torch.nn.Linear(IN, OUT)
        self.c = torch.nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x[:, 0]) + self.b(x[:, 1]) + self.c(x[:, 2])


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _engine(model: torch.nn.Module, stage: int, precision: str, **extra: Any) -> Any:
    zero = {"stage": stage, "reduce_bucket_size": 40, "stage3_param_persistence_threshold": 0}
    zero.update(extra.pop("zero", {}))
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": 1,
        "optimizer": OPTIMIZER,
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "zero_optimization": zero,
        **PRECISIONS[precision],
        **extra,
    }
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _listen(engine: Any) -> Records:
    records = Records()
    engine.logger.addHandler(records)
    engine.logger.setLevel(logging.INFO)
    return records


def _snapshot(engine: Any) -> list[torch.Tensor]:
    """Everything a step may change on this rank: the model's (local) parameters, the stepped tensors and their
    optimizer states, bitwise."""
    engine.states.wait_params()  # direct reads below: land pending parameter gathers first
    out = [p.detach().clone() for p in engine.module.parameters()]
    for group in engine.optimizer.param_groups:
        for t in group["params"]:
            out.append(t.detach().clone())
            out.extend(v.detach().clone() for v in engine.optimizer.state.get(t, {}).values() if torch.is_tensor(v))
    return out


def _bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


# --- the case: NaN in one rank's input under fp32 with clipping ------------------------------------------
STEPS, BAD_STEP = 5, 2  # the third step (index 2) sees rank 1's poisoned batch


def _nan_input_run(rank: int, world: int, stage: int, precision: str, zero: dict) -> dict:
    engine = _engine(make_model(), stage, precision, zero=zero)
    records = _listen(engine)
    dtype = next(engine.module.parameters()).dtype
    before = after = None
    for i, (x, y) in enumerate(global_batches(STEPS, MB * world)):
        x = rank_slice(x, 0, rank, world, MB).clone()
        if i == BAD_STEP and rank == 1:
            x[1, 3] = float("nan")
        loss = F.mse_loss(engine(x.to(dtype)).float(), rank_slice(y, 0, rank, world, MB))
        engine.backward(loss)
        if i == BAD_STEP:
            before = _snapshot(engine)
        engine.step()
        if i == BAD_STEP:
            after = _snapshot(engine)
            applied = engine.was_step_applied()
    full = engine.module_state_dict()
    return {
        "params": {n: full[n].float().clone() for n, _ in engine.module.named_parameters()},
        "unchanged": _bitwise_equal(before, after),
        "applied": applied,
        "skipped": engine.skipped_steps,
        "global": engine.global_steps,
        "lines": records.lines,
    }


def _reference_skipping(skip: int) -> dict[str, torch.Tensor]:
    """Plain torch on the whole global batch, AdamW and clip_grad_norm_ as the engine's, never stepping ``skip``."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for i, (x, y) in enumerate(global_batches(STEPS, MB * 2)):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if i != skip:
            opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _check_nan_input(results: list[dict], tolerance: float) -> None:
    reference = _reference_skipping(BAD_STEP)
    for r in results:
        assert r["unchanged"], "the skipped step changed a parameter or an optimizer state"
        assert r["applied"] is False
        assert (r["skipped"], r["global"]) == (1, STEPS)  # DeepSpeed: both advance on a skipped step
        for name, value in r["params"].items():
            assert torch.isfinite(value).all(), name
            assert torch.allclose(value, reference[name], atol=tolerance, rtol=0), name
    assert all(torch.equal(results[0]["params"][n], results[1]["params"][n]) for n in results[0]["params"])
    reports = [line for line in results[0]["lines"] if "first non-finite gradient" in line]
    assert len(reports) == 1 and reports[0].startswith(f"step {BAD_STEP + 1}:") and "inp.weight" in reports[0]
    assert not any("first non-finite gradient" in line for line in results[1]["lines"]), "reported on rank 0 only"


@pytest.mark.parametrize("stage", [*(pytest.param(s, marks=pytest.mark.slow) for s in (0, 1, 2)), 3])
def test_nan_input_on_one_rank_skips_the_step_everywhere_fp32(dist_run, stage: int) -> None:
    _check_nan_input(dist_run(_nan_input_run, 2, stage, "fp32", {}), 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,zero",
    [
        (1, {"offload_optimizer": {"device": "cpu"}}),
        (2, {"offload_optimizer": {"device": "cpu"}}),
        (3, {"offload_optimizer": {"device": "cpu"}}),
        (3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
    ],
    ids=["1-optimizer", "2-optimizer", "3-optimizer", "3-optimizer-param"],
)
def test_nan_input_skips_under_offload(dist_run, stage: int, zero: dict) -> None:
    _check_nan_input(dist_run(_nan_input_run, 2, stage, "fp32", zero), 1e-5)


def _resume_after_skip(rank: int, world: int, stage: int, save_dir: str) -> dict:
    """Save right after the skipped step, resume in a fresh engine, finish: as the uninterrupted run."""
    batches = global_batches(STEPS, MB * world)

    def train(engine: Any, steps: range) -> None:
        for i in steps:
            x = rank_slice(batches[i][0], 0, rank, world, MB).clone()
            if i == BAD_STEP and rank == 1:
                x[1, 3] = float("nan")
            engine.backward(F.mse_loss(engine(x), rank_slice(batches[i][1], 0, rank, world, MB)))
            engine.step()

    first = _engine(make_model(), stage, "fp32")
    train(first, range(BAD_STEP + 1))
    first.save_checkpoint(save_dir)
    resumed = _engine(make_model(seed=7), stage, "fp32")
    resumed.load_checkpoint(save_dir)
    counters = (resumed.global_steps, resumed.skipped_steps)
    train(resumed, range(BAD_STEP + 1, STEPS))
    full = resumed.module_state_dict()
    return {"counters": counters, "params": {n: full[n].clone() for n, _ in resumed.module.named_parameters()}}


@pytest.mark.slow
def test_resume_after_a_skipped_step_matches_the_uninterrupted_run(dist_run, tmp_path) -> None:
    reference = _reference_skipping(BAD_STEP)
    for r in dist_run(_resume_after_skip, 2, 2, str(tmp_path / "ckpt")):
        assert r["counters"] == (BAD_STEP + 1, 1)  # skipped_steps is saved; the consecutive count is not
        for name, value in r["params"].items():
            assert torch.allclose(value, reference[name], atol=1e-5, rtol=0), name


# --- first offending parameter and the k-consecutive stop --------------------------------------------------------
LIMIT = 3


def _storm_run(rank: int, world: int, stage: int, precision: str) -> dict:
    torch.manual_seed(0)
    engine = _engine(
        Branches(),
        stage,
        precision,
        fault_tolerance={"max_consecutive_nonfinite": LIMIT},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": LR}},
    )
    records = _listen(engine)
    dtype = next(engine.module.parameters()).dtype
    g = torch.Generator().manual_seed(rank)
    error, clean, lr_state = None, None, None
    for step in range(1, 10):
        x = torch.randn(MB, 3, IN, generator=g)
        if step >= 2:  # b's input on rank 1, c's on rank 0: the first offender in registration order is b.weight
            x[0, 1 if rank == 1 else 2, 0] = float("nan")
        engine.backward(engine(x.to(dtype)).float().sum() * 1e-3)
        try:
            engine.step()
        except Exception as exc:
            error = exc
            break
        if step == 1:
            clean, lr_state = _snapshot(engine), engine.lr_scheduler.state_dict()
    return {
        "error": f"{type(error).__name__}: {error}",
        "unchanged": _bitwise_equal(clean, _snapshot(engine)),
        "lr_unchanged": engine.lr_scheduler.state_dict() == lr_state,
        "counters": (engine.global_steps, engine.skipped_steps),
        "lines": records.lines,
    }


def _check_storm(results: list[dict]) -> None:
    for r in results:
        assert r["error"].startswith("NonFiniteGradientsError: 3 consecutive steps had NaN/Inf gradients (steps 2-4")
        assert "first offending parameter at the first of them: b.weight" in r["error"]
        assert r["unchanged"] and r["lr_unchanged"]
        assert r["counters"] == (1 + LIMIT, LIMIT)
    reports = [line for line in results[0]["lines"] if "first non-finite gradient" in line]
    assert [line.split(":")[0] for line in reports] == ["step 2", "step 3", "step 4"]
    assert all("(registration order): b.weight" in line for line in reports)


KINDS = [(s, p) for s in (0, 1, 2, 3) for p in PRECISIONS]
FAST = {(2, "bf16")}


@pytest.mark.parametrize(
    "stage,precision", [pytest.param(*k, marks=() if k in FAST else pytest.mark.slow) for k in KINDS]
)
def test_consecutive_nonfinite_steps_report_first_parameter_and_raise(dist_run, stage: int, precision: str) -> None:
    try:
        results = dist_run(_storm_run, 2, stage, precision)
    except RankFailure as failure:  # pragma: no cover - a failure inside the ranks, shown in full
        raise AssertionError(str(failure)) from None
    _check_storm(results)


# --- skip_nonfinite_steps settings and a NaN/Inf loss --------------------------------------------------------------
def _settings_run(rank: int, world: int) -> dict:
    out = {}
    cases = {
        "null_clip": ({}, CLIP, "nan_input"),
        "null_noclip": ({}, 0.0, "nan_input"),
        "true_noclip": ({"skip_nonfinite_steps": True}, 0.0, "nan_input"),
        "false_clip": ({"skip_nonfinite_steps": False}, CLIP, "nan_input"),
        "inf_loss": ({}, CLIP, "inf_loss"),
        "nan_loss": ({}, CLIP, "nan_loss"),
        "nan_constant": ({}, CLIP, "nan_constant"),
    }
    for name, (fault_tolerance, clip, fault) in cases.items():
        engine = _engine(make_model(), 0, "fp32", gradient_clipping=clip, fault_tolerance=fault_tolerance)
        records = _listen(engine)
        x, y = global_batches(1, MB * world)[0]
        x = rank_slice(x, 0, rank, world, MB).clone()
        if fault == "nan_input" and rank == 1:
            x[0, 0] = float("nan")
        pred = engine(x)
        loss = F.mse_loss(pred, rank_slice(y, 0, rank, world, MB))
        if rank == 0 and fault == "inf_loss":
            loss = loss * float("inf")
        elif rank == 0 and fault == "nan_loss":  # log(0) = -inf in the graph: its backward is inf·0 = NaN
            loss = loss + torch.log(pred.sum() * 0)
        elif rank == 0 and fault == "nan_constant":  # NaN that no parameter influences: gradients stay finite
            loss = loss + float("nan")
        before = _snapshot(engine)
        engine.backward(loss)
        engine.step()
        out[name] = {
            "skipped": engine.skipped_steps,
            "unchanged": _bitwise_equal(before, _snapshot(engine)),
            "finite": all(torch.isfinite(p).all() for p in engine.module.parameters()),
            "lines": [line for line in records.lines if "non-finite" in line],
        }
        engine.logger.removeHandler(records)
    return out


def test_skip_nonfinite_steps_settings_and_nonfinite_loss(dist_run) -> None:
    results = dist_run(_settings_run, 2)
    for rank, r in enumerate(results):
        for skipped in ("null_clip", "true_noclip", "inf_loss", "nan_loss"):
            assert r[skipped]["skipped"] == 1 and r[skipped]["unchanged"], skipped
        # null without clipping: the norm is not computed on this step, so nothing is checked (the documented
        # cost-free default); false: the old behaviour, stepping anyway (weights become NaN) with a warning
        for stepped in ("null_noclip", "false_clip"):
            assert r[stepped]["skipped"] == 0 and not r[stepped]["finite"], stepped
        # a NaN loss whose NaN does not come from the parameters leaves the gradients finite: a normal step
        assert r["nan_constant"]["skipped"] == 0 and r["nan_constant"]["finite"] and not r["nan_constant"]["unchanged"]
        if rank == 0:
            assert "stepping anyway" in r["false_clip"]["lines"][0] and "inp.weight" in r["false_clip"]["lines"][0]
            assert "step skipped" in r["nan_loss"]["lines"][0] and "inp.weight" in r["nan_loss"]["lines"][0]
        assert r["null_noclip"]["lines"] == []


# --- fp16 overflow storm ----------------------------------------------------------------------------------------
PATIENCE = 3


def _fp16_storm(rank: int, world: int, stage: int) -> dict:
    engine = _engine(
        make_model(),
        stage,
        "fp32",
        fp16={"enabled": True, "initial_scale_power": 2, "hysteresis": 1, "min_loss_scale": 1},
        fault_tolerance={"min_loss_scale_patience": PATIENCE},
    )
    start = _snapshot(engine)
    scales, error = [], None
    for step in range(1, 20):
        x, y = global_batches(1, MB * world, seed=step)[0]
        loss = F.mse_loss(engine(rank_slice(x, 0, rank, world, MB).half()).float(), rank_slice(y, 0, rank, world, MB))
        engine.backward(loss * float("inf") if rank == 1 else loss)
        try:
            engine.step()
        except Exception as exc:
            error = exc
            break
        scales.append(engine.loss_scaler.scale)
    return {
        "error": f"{type(error).__name__}: {error}",
        "scales": scales,
        "counters": (engine.global_steps, engine.skipped_steps),
        "unchanged": _bitwise_equal(start, _snapshot(engine)),
    }


@pytest.mark.parametrize("stage", [0, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_fp16_overflow_storm_stops_after_patience_at_min_scale(dist_run, stage: int) -> None:
    for r in dist_run(_fp16_storm, 2, stage):
        # 4 → 2 → 1 (two overflows lower the scale), then PATIENCE overflows at the minimum: the last one raises.
        # DeepSpeed would raise at the first overflow at the minimum (step 3).
        assert r["scales"] == [2.0, 1.0, 1.0, 1.0]
        assert r["error"].startswith(
            f"FP16ScaleStuckError: fp16 loss scale stuck at min_loss_scale=1 for {PATIENCE} steps (steps 3-5"
        ), r["error"]
        assert "the model overflows fp16 even unscaled; use bf16 or lower the LR" in r["error"]
        assert r["counters"] == (2 + PATIENCE, 2 + PATIENCE)
        assert r["unchanged"]


# --- the first-offender agreement over a real process group ---------------------------------------------------------
def _agree(rank: int, world: int) -> list:
    import torch.distributed as dist

    from shardspeed.comm import Collectives
    from shardspeed.topology import AxisGroup
    from shardspeed.training.nonfinite import agree_first_nonfinite

    axis = AxisGroup("data", dist.group.WORLD, tuple(range(world)), rank)
    order = ["a.weight", "a.bias", "b.weight", "b.bias", "c.weight"]
    local = [["c.weight"], ["b.bias", "b.weight"]][rank]  # each rank sees only its shard's offenders
    return [
        agree_first_nonfinite(local, order, Collectives(), axis, torch.device("cpu")),
        agree_first_nonfinite([] if rank == 0 else ["c.weight"], order, Collectives(), axis, torch.device("cpu")),
        agree_first_nonfinite([], order, Collectives(), axis, torch.device("cpu")),
    ]


def test_first_offender_agreed_across_ranks_shards(dist_run) -> None:
    assert dist_run(_agree, 2) == [["b.weight", "c.weight", None]] * 2
