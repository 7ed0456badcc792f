"""Preemption and automatic resume, engine side (issue #13): a preemption signal on any rank stops every rank at
the same step boundary, saves and raises ``Preempted``; ``fault_tolerance.auto_resume`` continues a run from its
last save with the same data order and RNG as an uninterrupted run (dropout on, shuffled data), whether the loader
is the engine's (``training_data=``) or the script's own."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import shardspeed
from shardspeed.faults.preemption import PREEMPTED_EXIT_CODE, Preempted

IN, HIDDEN, OUT = 6, 16, 3
MB, GAS = 2, 2


class DropoutNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.drop = torch.nn.Dropout(0.3)
        self.fc2 = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, IN, generator=g)  # 40 samples, global batch 8: 5 steps an epoch, so runs cross epochs
    return torch.utils.data.TensorDataset(x, torch.tanh(x @ torch.randn(IN, OUT, generator=g)))


def _config(stage: int, ckpt: Path, **fault_tolerance: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
        "fault_tolerance": {"checkpoint_dir": str(ckpt), **fault_tolerance},
    }


def _build(stage: int, ckpt: Path, engine_loader: bool, **fault_tolerance: object):
    torch.manual_seed(0)  # as a script does at its top: a restart runs this again, auto_resume then restores RNG
    model = DropoutNet()
    engine, _, loader, _ = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        training_data=_dataset() if engine_loader else None,
        config=_config(stage, ckpt, **fault_tolerance),
    )
    return engine, loader


def _script_batches(engine, world: int, rank: int):
    """What a script iterating its own DataLoader does to resume exactly (README, "Preemption and elastic
    restarts"): a sampler seeded per epoch (``set_epoch``), the micro-batches already trained skipped, and a
    private generator for the DataLoader (each ``iter()`` otherwise draws a seed from the global RNG, which the
    resumed run would then draw at a different point than the uninterrupted one: different dropout masks)."""
    dataset = _dataset()
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=5)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=MB, sampler=sampler, drop_last=True, generator=torch.Generator().manual_seed(5)
    )
    done = engine.global_steps * GAS  # micro-batches this rank already trained on
    epoch, skip = divmod(done, len(loader))
    while True:
        sampler.set_epoch(epoch)
        for index, batch in enumerate(loader):
            if index >= skip:
                yield batch
        epoch, skip = epoch + 1, 0


def _train_to(engine, batches, total_steps: int, on_step=None) -> None:
    while engine.global_steps < total_steps:
        x, y = next(batches)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        if on_step is not None and engine.micro_steps % GAS == 0:
            on_step(engine.global_steps)


def _batches(engine, loader, world: int, rank: int):
    if loader is not None:
        return iter(shardspeed.RepeatingLoader(loader))
    return _script_batches(engine, world, rank)


def _params(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.module_state_dict().items()}


# --- preemption ---------------------------------------------------------------------------------------------------
def _preempt(rank: int, world: int, ckpt: Path, signal_at: dict[int, int]) -> dict:
    """Signal this rank (itself) after the optimizer step ``signal_at[rank]``; train until stopped."""
    engine, loader = _build(1, ckpt, True, save_on_preemption=True)
    batches = iter(shardspeed.RepeatingLoader(loader))

    def on_step(step: int) -> None:
        if signal_at.get(rank) == step:
            os.kill(os.getpid(), signal.SIGTERM)  # only this rank gets it (or gets it at its own step)

    start = time.monotonic()
    try:
        _train_to(engine, batches, 50, on_step)
    except Preempted as stop:
        return {
            "code": stop.code,
            "message": str(stop),
            "step": stop.step,
            "checkpoint": str(stop.checkpoint),
            "handler_restored": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "seconds": time.monotonic() - start,
        }
    return {"code": None}


@pytest.mark.parametrize(
    "signal_at", [{1: 2}, {0: 3, 1: 2}], ids=["one-rank-signalled", "ranks-signalled-at-different-steps"]
)
def test_preemption_stops_every_rank_at_one_boundary_and_saves(dist_run, tmp_path: Path, signal_at) -> None:
    ckpt = tmp_path / "ckpt"
    results = dist_run(_preempt, 2, ckpt, signal_at)
    # The signal arrived after step 2 on the first rank to get it: both ranks agree at step 3's boundary.
    for result in results:
        assert result["code"] == PREEMPTED_EXIT_CODE
        assert result["step"] == 3
        assert result["message"].startswith(f"preempted by SIGTERM at step 3; checkpoint saved to {ckpt}")
        assert result["checkpoint"] == str(ckpt / "global_step3")
        assert result["handler_restored"]
        assert result["seconds"] < 60
    assert (ckpt / "latest").read_text().strip() == "global_step3"


# --- automatic resume -------------------------------------------------------------------------------------------
def _resume(rank: int, world: int, root: Path, stage: int, engine_loader: bool, save_at: int, total: int) -> float:
    # uninterrupted reference
    engine, loader = _build(stage, root / "unused", engine_loader)
    _train_to(engine, _batches(engine, loader, world, rank), total)
    reference = _params(engine)
    engine.destroy()
    # attempt 1: saves at ``save_at`` and dies (here: stops) one step later, past its save
    ckpt = root / "ckpt"
    engine, loader = _build(stage, ckpt, engine_loader, auto_resume=True)
    assert engine.global_steps == 0  # nothing to resume from yet
    batches = _batches(engine, loader, world, rank)
    _train_to(engine, batches, save_at)
    engine.save_checkpoint(str(ckpt))
    _train_to(engine, batches, save_at + 1)
    engine.destroy()
    torch.manual_seed(1234)  # whatever the dead process left in the RNG is gone in a real restart
    # attempt 2: the same script from the top, auto_resume loads global_step{save_at}
    engine, loader = _build(stage, ckpt, engine_loader, auto_resume=True)
    assert engine.global_steps == save_at
    _train_to(engine, _batches(engine, loader, world, rank), total)
    resumed = _params(engine)
    engine.destroy()
    return max((reference[k] - resumed[k]).abs().max().item() for k in reference)


@pytest.mark.parametrize(
    ("stage", "engine_loader"),
    [(2, True), (1, False), (3, True)],
    ids=["engine-loader-zero2", "script-loader-zero1", "engine-loader-zero3"],
)
def test_auto_resume_reproduces_uninterrupted_run(dist_run, tmp_path: Path, stage: int, engine_loader: bool) -> None:
    # save at step 3 (mid-epoch: 5 steps an epoch), stop at 4, resume to 7 (crosses into the second epoch)
    diffs = dist_run(_resume, 2, tmp_path, stage, engine_loader, 3, 7)
    assert max(diffs) <= 1e-6, diffs


# --- the Hugging Face Trainer path ------------------------------------------------------------------------------
def _hf_preempt(rank: int, world: int, out: str, ckpt: str) -> dict:
    pytest.importorskip("transformers")
    import transformers
    from hf_runs import GAS as HF_GAS
    from hf_runs import MB as HF_MB
    from hf_runs import build_model, dataset, ds_config
    from transformers import TrainerCallback, TrainingArguments

    from shardspeed.integrations.hf import ShardSpeedTrainer

    class SignalRank1(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # after engine.step() of optimizer step 1
            if rank == 1 and state.global_step == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    transformers.logging.set_verbosity_error()
    config = ds_config({"stage": 2}, fault_tolerance={"checkpoint_dir": ckpt, "save_on_preemption": True})
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=HF_MB,
        gradient_accumulation_steps=HF_GAS,
        max_steps=6,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = ShardSpeedTrainer(
        model=build_model("gpt2"),
        args=args,
        train_dataset=dataset(),
        shardspeed_config=config,
        callbacks=[SignalRank1()],
    )
    try:
        trainer.train()
    except Preempted as stop:
        result = {"code": stop.code, "step": stop.step}
    else:
        result = {"code": None}
    config["fault_tolerance"]["auto_resume"] = True  # the Trainer's own step and data position would not follow
    trainer = ShardSpeedTrainer(model=build_model("gpt2"), args=args, train_dataset=dataset(), shardspeed_config=config)
    try:
        trainer.train()
    except ValueError as error:
        result["auto_resume_error"] = str(error)
    return result


@pytest.mark.slow
def test_hf_trainer_is_preempted_like_a_script(dist_run, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    results = dist_run(_hf_preempt, 2, str(tmp_path / "out"), str(ckpt))
    assert [r["code"] for r in results] == [PREEMPTED_EXIT_CODE] * 2
    assert [r["step"] for r in results] == [2, 2]  # signalled on rank 1 after step 1: both stop after step 2
    assert (ckpt / "latest").read_text().strip() == "global_step2"
    for result in results:
        assert "fault_tolerance.auto_resume" in result["auto_resume_error"]
        assert "resume_from_checkpoint=True" in result["auto_resume_error"]
