"""DeepSpeed config spellings and combinations that DeepSpeed accepts and shardspeed used to refuse: the legacy
``"zero_optimization": true``, ``offload_param`` below stage 3, Adam ``bias_correction: false``, a client
optimizer next to a config ``optimizer`` section, a client LR scheduler next to a config ``scheduler`` section."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

import shardspeed
from shardspeed.config import load_config
from shardspeed.log import logger as shardspeed_logger
from shardspeed.ops.adam import FusedAdam
from shardspeed.optim.build import build_optimizer

MICRO1 = {"train_micro_batch_size_per_gpu": 1}


@pytest.fixture
def warnings_logged() -> Iterator[list[str]]:
    """Messages shardspeed's logger emits (it does not propagate to the root logger, so caplog misses them)."""
    seen: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                seen.append(record.getMessage())

    handler = _Collect()
    shardspeed_logger.addHandler(handler)
    try:
        yield seen
    finally:
        shardspeed_logger.removeHandler(handler)


@pytest.mark.parametrize(("value", "stage"), [(True, 1), (False, 0)])
def test_zero_optimization_bool_is_deepspeeds_stage(value: bool, stage: int) -> None:
    config = load_config({**MICRO1, "zero_optimization": value}, dp_world_size=1)
    assert config.zero_optimization.stage == stage
    assert config.zero_optimization.offload_param is None and config.zero_optimization.overlap_comm is True


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_param_below_stage_3_is_one_warning_and_dropped(stage: int, device: str) -> None:
    # DeepSpeed-Chat's get_train_ds_config writes offload_param for every stage (no nvme_path needed: unused).
    zero = {"stage": stage, "offload_param": {"device": device, "pin_memory": True}}
    config = load_config({**MICRO1, "zero_optimization": zero}, dp_world_size=1)
    assert config.zero_optimization.offload_param is None
    notes = [w for w in config.warnings if "offload_param" in w]
    assert notes == [
        f'"zero_optimization.offload_param" (device "{device}") has no effect at ZeRO stage {stage} '
        "(only stage 3 shards the parameters); ignored, as DeepSpeed does"
    ]


def test_offload_param_at_stage_3_is_still_checked() -> None:
    from shardspeed.config import ConfigError

    with pytest.raises(ConfigError, match=r'offload_param" with device "nvme" needs "nvme_path"'):
        load_config({**MICRO1, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, dp_world_size=1)


def test_offload_param_warning_is_logged_once_by_initialize(warnings_logged: list[str]) -> None:
    config = {
        **MICRO1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}},
    }
    shardspeed.initialize(model=torch.nn.Linear(4, 4), config=config)
    assert sum("offload_param" in message for message in warnings_logged) == 1


@pytest.mark.parametrize(("type_name", "adam_w_mode"), [("Adam", True), ("Adam", False), ("AdamW", True)])
def test_adam_without_bias_correction_follows_the_formula(type_name: str, adam_w_mode: bool) -> None:
    """Two steps of Adam with bias correction off equal the uncorrected formula written out by hand."""
    lr, b1, b2, eps, wd = 0.1, 0.9, 0.99, 1e-8, 0.01
    params_cfg = {"lr": lr, "betas": [b1, b2], "eps": eps, "weight_decay": wd, "bias_correction": False}
    if type_name == "Adam":
        params_cfg["adam_w_mode"] = adam_w_mode
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))  # fp32 (the kernel's math); reference in fp64
    optimizer = build_optimizer(type_name, params_cfg, [param])
    assert type(optimizer) is FusedAdam and optimizer.defaults["bias_correction"] is False
    grads = [torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64), torch.tensor([-0.3, 0.2, 1.0], dtype=torch.float64)]
    w, m, v = param.detach().double(), torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for grad in grads:
        param.grad = grad.float()
        optimizer.step()
        g = grad + wd * w if not adam_w_mode else grad
        if adam_w_mode:
            w = w * (1 - lr * wd)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        w = w - lr * m / (v.sqrt() + eps)
    torch.testing.assert_close(param.detach().double(), w, rtol=0, atol=1e-6)
    # bias correction on would move the first step by lr (|m_hat / sqrt(v_hat)| ~ 1), far outside that tolerance


def test_client_optimizer_wins_over_the_config_section_with_a_warning(warnings_logged: list[str]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    client = torch.optim.SGD(model.parameters(), lr=0.5)
    config = {**MICRO1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, optimizer, _, _ = shardspeed.initialize(model=model, optimizer=client, config=config)
    inner = [o for o in (optimizer, getattr(optimizer, "optimizer", None)) if isinstance(o, torch.optim.Optimizer)]
    assert any(type(o) is torch.optim.SGD for o in inner), type(optimizer)
    notes = [m for m in warnings_logged if "client optimizer" in m]
    assert len(notes) == 1 and "SGD" in notes[0] and '"AdamW"' in notes[0], warnings_logged
    # and the client's SGD is what steps: w <- w - 0.5 * grad
    before = model.weight.detach().clone()
    x = torch.ones(1, 4)
    loss = engine(x).sum()
    engine.backward(loss)
    engine.step()
    torch.testing.assert_close(engine.module.weight.detach(), before - 0.5 * torch.ones(2, 4))


def test_client_callable_wins_over_the_config_section(warnings_logged: list[str]) -> None:
    params = [torch.nn.Parameter(torch.ones(2))]
    built = build_optimizer("Adam", {}, params, user_optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert type(built) is torch.optim.SGD
    assert any("client optimizer (a callable" in m and '"Adam"' in m for m in warnings_logged), warnings_logged


@pytest.mark.parametrize("as_callable", [False, True])
def test_client_lr_scheduler_wins_over_the_config_section_with_a_warning(
    warnings_logged: list[str], as_callable: bool
) -> None:
    """DeepSpeed 0.19's ``_configure_lr_scheduler``: a client scheduler (instance or callable) is used and the config's
    ``scheduler`` is never built. Before, shardspeed refused the pair with a ConfigError."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    client = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    config = {
        **MICRO1,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 5}},
    }
    engine, _, _, scheduler = shardspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=(lambda opt: client) if as_callable else client, config=config
    )
    assert scheduler is client and engine.lr_scheduler is client
    notes = [m for m in warnings_logged if "client LR scheduler" in m]
    assert len(notes) == 1 and '"WarmupLR"' in notes[0], warnings_logged
    for _ in range(2):
        engine.backward(engine(torch.ones(1, 4)).sum())
        engine.step()
    # StepLR halves the lr each step: 1.0 -> 0.25 after two (WarmupLR would have started at 0 and risen)
    assert [group["lr"] for group in optimizer.param_groups] == [0.25]
