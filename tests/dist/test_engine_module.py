"""The engine is an nn.Module (as DeepSpeedEngine): parameters/state_dict/load_state_dict/to/train/hooks/attribute
pass-through, and DeepSpeed's engine methods the issue lists (local_rank … load_checkpoint(custom_load_fn=))."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from parity import full_params, global_batches, make_model, rank_slice, train_engine

import shardspeed
from shardspeed.utils import safe_get_full_grad

MB, GAS, LR = 2, 2, 0.05


def _engine(stage: int, world: int, *, bf16: bool = False, fp16: bool = False, optimizer: str = "SGD", **extra):
    model = extra.pop("model", None) or make_model()
    params = {"lr": LR, "momentum": 0.9} if optimizer == "SGD" else {"lr": LR}
    config = {
        "train_batch_size": MB * GAS * world,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": optimizer, "params": params},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": fp16, "initial_scale_power": 8, "hysteresis": 1},
        "steps_per_print": 1000,
    }
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config, **extra)
    return engine


def _reference_from(state: dict[str, torch.Tensor], batches: list) -> dict[str, torch.Tensor]:
    """Plain-torch SGD(momentum) from ``state``."""
    model = make_model()
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _module_behaviour(rank: int, world: int, stage: int, bf16: bool) -> dict:
    engine = _engine(stage, world, bf16=bf16)
    assert isinstance(engine, torch.nn.Module) and isinstance(engine, shardspeed.DeepSpeedEngine)
    assert dict(engine.named_children()) == {"module": engine.module}
    assert [id(p) for p in engine.parameters()] == [id(p) for p in engine.module.parameters()]
    assert [n for n, _ in engine.named_parameters()] == [f"module.{n}" for n, _ in engine.module.named_parameters()]
    assert engine.module in list(engine.modules())
    engine.eval()
    assert not engine.training and not engine.module.training and not engine.module.inp.training
    engine.train()
    assert engine.training and engine.module.mid.training
    assert engine.inp is engine.module.inp  # attributes pass through to the model, as DeepSpeed's __getattr__
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        _ = engine.nonexistent
    calls = []
    handle = engine.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    x = torch.randn(MB, 7)
    engine(x.to(torch.bfloat16) if bf16 else x)
    handle.remove()
    assert engine.to(engine.device) is engine and engine.cpu() is engine  # no-op moves are fine
    dtype = torch.bfloat16 if bf16 else torch.float32
    assert engine.to(dtype) is engine
    with pytest.raises(RuntimeError, match=r"cannot move or cast the engine after initialize\(\): parameter 'module\."):
        engine.to(torch.float64)
    with pytest.raises(RuntimeError, match="cannot move or cast"):
        engine.half()
    # state_dict: DeepSpeed's keys; gathered whole values at every stage (ZeRO-3 included, collective)
    state = {k: v.clone() for k, v in engine.state_dict().items()}  # stages 0-2: views of the live values
    assert list(state) == [f"module.{k}" for k in make_model().state_dict()]
    if stage == 3:
        with pytest.raises(ValueError, match="placeholders"):
            engine.state_dict(keep_vars=True)
    # load_state_dict: another model's weights go through the stage into masters/shards and train from there
    other = make_model(seed=5).state_dict()
    if stage == 3:  # the bare module's own load_state_dict cannot write into placeholders silently: torch refuses
        with pytest.raises(RuntimeError, match="size mismatch"):
            engine.module.load_state_dict(other)
    result = engine.load_state_dict({f"module.{k}": v for k, v in other.items()})
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    loaded = full_params(engine)
    batches = global_batches(2, MB * GAS * world)
    train_engine(engine, rank, world, batches, MB, GAS)
    trained = full_params(engine)
    with pytest.raises(RuntimeError, match=r"missing keys \['module.out.bias'\]"):
        engine.load_state_dict({f"module.{k}": v for k, v in other.items() if k != "out.bias"})
    partial = engine.load_state_dict({"module.out.bias": torch.zeros(3)}, strict=False)
    return {
        "calls": calls,
        "state": {k: v.float().clone() for k, v in state.items()},
        "loaded": loaded,
        "trained": trained,
        "missing": len(partial.missing_keys),
        "out_bias": full_params(engine)["out.bias"],
    }


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("stage", "bf16"),
    [
        (0, False),
        (3, True),
        pytest.param(1, True, marks=SLOW),
        pytest.param(2, False, marks=SLOW),
        pytest.param(3, False, marks=SLOW),
    ],
)
def test_engine_is_an_nn_module(dist_run, stage: int, bf16: bool) -> None:
    world = 2
    results = dist_run(_module_behaviour, world, stage, bf16)
    initial = make_model().state_dict()
    other = make_model(seed=5).state_dict()
    reference = _reference_from(other, global_batches(2, MB * GAS * world))
    tolerance = 2e-2 if bf16 else 1e-5
    for result in results:
        assert result["calls"] == [torch.Size([MB, 3])]
        for name, value in initial.items():
            expected = value.to(torch.bfloat16).float() if bf16 else value
            assert torch.equal(result["state"][f"module.{name}"], expected), name
        for name, value in other.items():
            expected = value.to(torch.bfloat16).float() if bf16 else value
            assert torch.equal(result["loaded"][name], expected), name
        for name, value in reference.items():
            assert (result["trained"][name] - value).abs().max().item() <= tolerance, name
        assert result["missing"] == len(initial) - 1 and torch.equal(result["out_bias"], torch.zeros(3))


class _RecordingScheduler:
    """A client LR scheduler whose step takes keyword arguments (DeepSpeed passes ``lr_kwargs`` to it)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def step(self, **kwargs: object) -> None:
        self.calls.append(kwargs)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...


def _methods(rank: int, world: int) -> dict:
    scheduler = _RecordingScheduler()
    engine = _engine(1, world, optimizer="AdamW", lr_scheduler=scheduler)
    out = {
        "local_rank": engine.local_rank,
        "world_size": engine.world_size,
        "mp_world_size": engine.mp_world_size,
        "zero_optimization": engine.zero_optimization(),
        "steps_per_print": engine.steps_per_print(),
        "partition": (engine.zero_optimization_partition_gradients(), engine.zero_optimization_partition_weights()),
        "mom": engine.get_mom(),
        "loss_scale": (engine.get_loss_scale(), engine.cur_scale),
    }
    x, y = global_batches(1, MB * world * 4)[0]
    applied, returned = [], []
    for m in range(GAS):
        loss = F.mse_loss(engine(rank_slice(x, m, rank, world, MB)), rank_slice(y, m, rank, world, MB))
        returned.append((engine.backward(loss).item(), loss.item()))
        engine.step(lr_kwargs={"increment": m})
        applied.append(engine.was_step_applied())
    out["applied"], out["returned"], out["lr_calls"] = applied, returned, list(scheduler.calls)
    # scale_wrt_gas=False: the gradient is GAS times the scaled one (lr 0: both windows see the same parameters)
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    grads = {}
    for scale in (True, False):
        for m in range(GAS):
            loss = F.mse_loss(engine(rank_slice(x, m, rank, world, MB)), rank_slice(y, m, rank, world, MB))
            engine.backward(loss, scale_wrt_gas=scale)
            if m < GAS - 1:
                engine.step()
        grads[scale] = safe_get_full_grad(engine.module.out.weight)
        engine.step()
    out["grad_ratio"] = (grads[False] / grads[True]).mean().item()
    # set_train_batch_size: DeepSpeed changes gradient accumulation, the micro batch stays
    engine.set_train_batch_size(MB * world * 4)
    out["after_resize"] = (engine.gradient_accumulation_steps(), engine.train_batch_size())
    boundaries = []
    for m in range(4):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(F.mse_loss(engine(rank_slice(x, m, rank, world, MB)), rank_slice(y, m, rank, world, MB)))
        engine.step()
    out["boundaries"] = boundaries
    with pytest.raises(ValueError, match="multiple of micro batch"):
        engine.set_train_batch_size(3)
    return out


def test_deepspeed_engine_methods(dist_run) -> None:
    results = dist_run(_methods, 2)
    for rank, r in enumerate(results):
        assert (r["local_rank"], r["world_size"], r["mp_world_size"]) == (rank, 2, 1)
        assert r["zero_optimization"] is True and r["steps_per_print"] == 1000 and r["partition"] == (False, False)
        assert r["mom"] == [(0.9, 0.999)] and r["loss_scale"] == (1.0, 1.0)
        assert r["applied"] == [False, True]  # a non-boundary micro-step applies nothing
        assert all(abs(scaled - loss / GAS) < 1e-7 for scaled, loss in r["returned"])  # loss / GAS, as DeepSpeed
        assert r["lr_calls"] == [{"increment": 1}]  # the scheduler steps on the boundary, with lr_kwargs
        assert abs(r["grad_ratio"] - GAS) < 1e-4
        assert r["after_resize"] == (4, 2 * MB * 4)
        assert r["boundaries"] == [False, False, False, True]


def _fp16_overflow(rank: int, world: int) -> dict:
    engine = _engine(0, world, fp16=True)
    scale = engine.get_loss_scale()
    x, y = global_batches(1, MB * world * GAS)[0]
    for m in range(GAS):
        out = engine(rank_slice(x, m, rank, world, MB).half()).float()
        engine.backward(F.mse_loss(out, rank_slice(y, m, rank, world, MB)) * float("inf"))
        engine.step()
    return {"scale": scale, "after": engine.cur_scale, "applied": engine.was_step_applied(), "mom": engine.get_mom()}


def test_was_step_applied_is_false_after_an_fp16_overflow(dist_run) -> None:
    for r in dist_run(_fp16_overflow, 2):
        assert r["scale"] == 2.0**8 and r["after"] == 2.0**7  # dynamic scaling halved it
        assert r["applied"] is False and r["mom"] == [0.9]


def _checkpoint_kwargs(rank: int, world: int, stage: int, save_dir: str) -> dict:
    model = make_model(frozen=True)
    engine = _engine(stage, world, model=model)
    train_engine(engine, rank, world, global_batches(1, MB * GAS * world), MB, GAS)
    engine.save_checkpoint(save_dir, tag="nofrozen", exclude_frozen_parameters=True)
    saved = full_params(engine)
    fresh = _engine(stage, world, model=make_model(seed=3, frozen=True))
    with pytest.raises(ValueError, match=r"missing \['inp.bias'\]"):
        fresh.load_checkpoint(save_dir, tag="nofrozen")
    fresh.load_checkpoint(save_dir, tag="nofrozen", load_module_strict=False)
    partial = full_params(fresh)

    def zero_out_weight(src: dict, dst: torch.nn.Module) -> None:
        with torch.no_grad():
            for name, p in dst.named_parameters():
                if name in src:
                    p.copy_(src[name])
            dst.out.weight.zero_()

    fresh.load_checkpoint(save_dir, tag="nofrozen", load_module_strict=False, custom_load_fn=zero_out_weight)
    custom = full_params(fresh)
    train_engine(fresh, rank, world, global_batches(1, MB * GAS * world, seed=4), MB, GAS)
    fp16_file = fresh.save_fp16_model(str(Path(save_dir) / "fp16"))
    return {"saved": saved, "partial": partial, "custom": custom, "fp16": fp16_file}


@pytest.mark.parametrize("stage", [3, pytest.param(0, marks=SLOW)])
def test_checkpoint_kwargs_exclude_frozen_and_custom_load_fn(dist_run, tmp_path: Path, stage: int) -> None:
    results = dist_run(_checkpoint_kwargs, 2, stage, str(tmp_path / "ckpt"))
    fresh_frozen = make_model(seed=3, frozen=True).inp.bias
    for r in results:
        for name, value in r["saved"].items():
            expected = fresh_frozen if name == "inp.bias" else value  # the frozen one was not in the checkpoint
            assert torch.equal(r["partial"][name], expected), name
            if name == "out.weight":
                assert torch.equal(r["custom"][name], torch.zeros_like(value))
            else:
                assert torch.equal(r["custom"][name], r["partial"][name]), name
        # ZeRO-3 saves 16-bit weights only with stage3_gather_16bit_weights_on_model_save (False, as DeepSpeed)
        assert r["fp16"] is (stage != 3)
    assert (tmp_path / "ckpt" / "fp16" / "pytorch_model.safetensors").exists() is (stage != 3)


@pytest.mark.slow
def test_torch_compile_of_the_engine() -> None:
    """torch.compile(engine) and engine.compile() (nn.Module's) run forward through the engine; backward/step still
    reach it (OptimizedModule passes attributes through). World of one; dynamo's eager backend."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    compiled = torch.compile(engine, backend="eager")
    x, y = torch.randn(2, 4), torch.randn(2, 2)
    compiled.backward(F.mse_loss(compiled(x), y))
    compiled.step()
    engine.compile(backend="eager")
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
    assert engine.global_steps == 2 and engine.was_step_applied()
    engine.destroy()  # in this process: its preemption handler must not outlive the test (forked tests inherit it)
