"""OneBitAdam without processes: DeepSpeed's warm-up formula pinned from its source (0.19.6
runtime/fp16/onebit/adam.py; the subprocess parity test runs DeepSpeed's class itself), the phase switch, the
config names and their errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import shardspeed
from shardspeed.compression.engine_wiring import (
    OptimizerOwnedGrads,
    bind_compressed_optimizer,
    check_compressed_setup,
    owns_communication,
)
from shardspeed.compression.onebit_adam import UPDATE_BLOCK, OneBitAdam, apply_update_
from shardspeed.compression.onebit_lamb import OneBitLamb
from shardspeed.compression.zero_one_adam import ZeroOneAdam
from shardspeed.config.errors import ConfigError
from shardspeed.optim import build_optimizer
from shardspeed.optim.specs import validate_optimizer_params


def _run(steps: int, freeze_step: int = 100, wd: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, OneBitAdam]:
    torch.manual_seed(0)
    p0 = torch.randn(6)
    p = torch.nn.Parameter(p0.clone())
    opt = OneBitAdam([p], lr=0.1, betas=(0.8, 0.9), eps=1e-3, weight_decay=wd, freeze_step=freeze_step)
    grads = [torch.randn(6) for _ in range(steps)]
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p0, torch.stack(grads), opt


def test_warmup_is_deepspeeds_formula() -> None:
    """Step 1 moves nothing (DeepSpeed's initialization step); then Adam with no bias correction, weight decay
    added to the update."""
    p0, grads, opt = _run(4, wd=0.05)
    p, m, v = p0.clone(), torch.zeros(6), torch.zeros(6)
    for g in grads[1:]:
        m = 0.8 * m + 0.2 * g
        v = 0.9 * v + 0.1 * g * g
        p = p - 0.1 * (m / (v.sqrt() + 1e-3) + 0.05 * p)
    (param,) = opt.param_groups[0]["params"]
    torch.testing.assert_close(param.detach(), p, atol=1e-6, rtol=0)
    torch.testing.assert_close(opt.state[param]["exp_avg"], m, atol=1e-7, rtol=0)
    assert opt.state[param]["step"] == 4


def test_first_step_only_counts() -> None:
    p0, _, opt = _run(1)
    (param,) = opt.param_groups[0]["params"]
    assert torch.equal(param.detach(), p0)
    assert not opt.state[param]["exp_avg"].any() and not opt.state[param]["exp_avg_sq"].any()


@pytest.mark.parametrize(("freeze_step", "switch"), [(0, 2), (1, 2), (2, 2), (5, 5)])
def test_compressed_phase_starts_after_freeze_step(freeze_step: int, switch: int) -> None:
    """DeepSpeed checks ``step >= freeze_step`` after each step from step 2 on (its first step returns early)."""
    _, _, opt = _run(switch - 1, freeze_step=freeze_step)
    assert not opt.owns_communication
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.zeros_like(p)
    opt.step()
    assert opt.owns_communication


def test_apply_update_matches_deepspeed_order() -> None:
    p, m, v = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.25]), torch.tensor([4.0, 0.0])
    apply_update_(p, m, v, lr=0.5, eps=1.0, weight_decay=0.1)
    expected = torch.tensor([1.0, -2.0]) - 0.5 * (torch.tensor([0.5 / 3.0, 0.25]) + 0.1 * torch.tensor([1.0, -2.0]))
    torch.testing.assert_close(p, expected)


def test_frozen_denominator_and_scratch_keep_the_bits() -> None:
    """[Note: frozen denominators]: the cached ``sqrt(v) + eps`` and the update scratch give DeepSpeed's bits
    (``p.add_(-lr * (m / (v.sqrt() + eps) + wd * p))``), and the cache follows in-place writes to ``v``."""
    g = torch.Generator().manual_seed(5)
    p, m, v = torch.randn(33, generator=g), torch.randn(33, generator=g), torch.rand(33, generator=g)
    deepspeed = p.clone()
    deepspeed.add_(-0.01 * (m / (v.sqrt() + 1e-8) + 0.1 * deepspeed))
    opt = OneBitAdam([torch.nn.Parameter(torch.zeros(1))])
    denom = opt._denominator(p, v, 1e-8)
    assert opt._denominator(p, v, 1e-8) is denom  # cached
    apply_update_(p, m, v, 0.01, 1e-8, 0.1, denom=denom, scratch=torch.empty(33))
    assert torch.equal(p, deepspeed)
    v.mul_(2.0)  # an in-place write (e.g. a loaded checkpoint): recomputed
    assert torch.equal(opt._denominator(p, v, 1e-8), v.sqrt() + 1e-8)


def test_blocked_frozen_update_keeps_deepspeeds_bits() -> None:
    """The compressed phase's update runs in blocks of ``UPDATE_BLOCK`` elements (a parameter of two blocks and a
    partial one, weight decay on, and a non-contiguous one that takes the whole-tensor path): the bits of
    DeepSpeed's whole-tensor ``p.add_(-lr * (m / (v.sqrt() + eps) + wd * p))``."""
    g = torch.Generator().manual_seed(11)
    big = torch.nn.Parameter(torch.randn(2 * UPDATE_BLOCK + 77, generator=g))
    strided = torch.nn.Parameter(torch.randn(40, 6, generator=g).t())  # not contiguous
    opt = OneBitAdam([big, strided], lr=0.01, weight_decay=0.1, freeze_step=2)
    for p in (big, strided):
        opt.state[p].update(
            step=5, exp_avg=torch.randn(p.shape, generator=g), exp_avg_sq=torch.rand(p.shape, generator=g)
        )
    expected = []
    for p in (big, strided):
        m, v = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]
        ds = p.detach().clone()
        ds.add_(-0.01 * (m / (v.sqrt() + 1e-8) + 0.1 * ds))
        expected.append(ds)
    with torch.no_grad():  # as inside step()
        opt._frozen_update([big, strided], opt.param_groups[0])
    assert torch.equal(big.detach(), expected[0]) and torch.equal(strided.detach(), expected[1])


def test_config_builds_onebit_adam_with_deepspeed_defaults() -> None:
    params = validate_optimizer_params("onebitadam", {"lr": 4e-4, "freeze_step": 23000, "cuda_aware": False})
    assert params["freeze_step"] == 23000 and params["comm_backend_name"] == "nccl" and params["betas"] == (0.9, 0.999)
    opt = build_optimizer("OneBitAdam", params, [torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, OneBitAdam) and opt.freeze_step == 23000 and opt.param_groups[0]["lr"] == 4e-4


@pytest.mark.parametrize(
    ("params", "pattern"),
    [
        ({"comm_backend_name": "gloo"}, r"optimizer\.params\.comm_backend_name must be one of .*\"nccl\""),
        ({"amsgrad": True}, r"optimizer\.params\.amsgrad=true is not supported"),
        ({"freeze_step": -1}, r"optimizer\.params\.freeze_step must be an integer >= 0"),
        ({"freeze_stp": 3}, r"did you mean \"freeze_step\""),
    ],
)
def test_config_errors_name_the_key(params: dict, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        validate_optimizer_params("OneBitAdam", params)


def test_client_instance_checks_backend_name() -> None:
    with pytest.raises(ValueError, match="comm_backend_name='gloo' is not one of DeepSpeed's"):
        OneBitAdam([torch.nn.Parameter(torch.zeros(1))], comm_backend_name="gloo")


def _axes(data: int = 2, tensor: int = 1, pipe: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        data=SimpleNamespace(size=data), tensor=SimpleNamespace(size=tensor), pipe=SimpleNamespace(size=pipe)
    )


def _zero(stage: int = 0, offload: str | None = None) -> SimpleNamespace:
    off = None if offload is None else SimpleNamespace(device=offload)
    return SimpleNamespace(zero_optimization=SimpleNamespace(stage=stage, offload_optimizer=off))


@pytest.mark.parametrize(
    ("config", "topology", "states", "pattern"),
    [
        (_zero(), _axes(tensor=2), SimpleNamespace(let_optimizer_communicate=None), r"tensor or pipeline axis"),
        (_zero(), _axes(pipe=2), SimpleNamespace(let_optimizer_communicate=None), r"tensor or pipeline axis"),
        (_zero(offload="cpu"), _axes(), SimpleNamespace(let_optimizer_communicate=None), r"offload_optimizer"),
        (_zero(stage=2), _axes(), SimpleNamespace(), r"ZeRO stage 2 is not supported"),
    ],
)
def test_engine_wiring_refuses_what_it_cannot_run(config, topology, states, pattern: str) -> None:
    opt = OneBitAdam([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(NotImplementedError, match=pattern):
        bind_compressed_optimizer(config, states, opt, topology, None, torch.device("cpu"))  # type: ignore[arg-type]


def test_owned_grads_skip_communication_only_while_the_optimizer_owns_it() -> None:
    calls: list[str] = []
    inner = SimpleNamespace(
        launch=lambda k: calls.append(f"launch{k}") or "work",
        complete=lambda k: calls.append(f"complete{k}"),
        zero=lambda: calls.append("zero"),
    )
    owns = [False]
    sync = OptimizerOwnedGrads(inner, lambda: owns[0])
    assert sync.launch(0) == "work"
    sync.complete(0)
    owns[0] = True
    work = sync.launch(1)
    assert work.done()  # a finished no-op: nothing issued
    sync.complete(1)
    sync.zero()  # everything else is the wrapped sync's
    assert calls == ["launch0", "complete0", "zero"]
    assert not owns_communication(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))


def test_load_state_dict_keeps_the_current_exp_avg_mask() -> None:
    """DeepSpeed's rule: the mask may change between training stages, so a saved one is never restored."""
    p = torch.nn.Parameter(torch.ones(2, 3))
    old, new = torch.ones(2, 3), torch.zeros(2, 3)
    saved = OneBitAdam([{"params": [p], "exp_avg_mask": old}]).state_dict()
    with_new = OneBitAdam([{"params": [p], "exp_avg_mask": new}])
    with_new.load_state_dict(saved)
    assert torch.equal(with_new.param_groups[0]["exp_avg_mask"], new)
    without = OneBitAdam([p])
    without.load_state_dict(saved)
    assert "exp_avg_mask" not in without.param_groups[0]


@pytest.mark.parametrize(
    ("config", "topology", "pattern"),
    [
        (_zero(stage=3), _axes(), r"stage 3 is not supported"),
        (_zero(stage=3), _axes(tensor=2), r"tensor or pipeline axis"),
        (_zero(stage=1, offload="cpu"), _axes(), r"offload_optimizer"),
        (_zero(stage=2), _axes(pipe=2), r"tensor or pipeline axis"),
    ],
)
def test_compressed_setup_names_the_real_obstacle_first(config, topology, pattern: str) -> None:
    opt = OneBitAdam([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises((NotImplementedError, ValueError), match=pattern):
        check_compressed_setup(config, opt, topology)  # type: ignore[arg-type]


def test_engine_refuses_onebit_adam_with_offload_at_stage_1() -> None:
    """The sharded OneBitAdam's compressed gradients would step the wrong tensors behind an offloaded optimizer
    (parameters grew to 2e6 in 5 steps): refused, before any stage-specific message."""
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}  # fmt: skip
    with pytest.raises(NotImplementedError, match="offload_optimizer"):
        shardspeed.initialize(model=torch.nn.Linear(4, 4), config=cfg)


def test_standalone_onebit_adam_runs_as_a_world_of_one() -> None:
    """Outside an engine (never bound) the compressed phase's mean is the identity: the frozen-variance update on
    the local momentum, exactly."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(6, generator=gen)
    grads = [torch.randn(6, generator=gen) for _ in range(6)]
    p = torch.nn.Parameter(start.clone())
    opt = OneBitAdam([p], lr=0.1, freeze_step=2, weight_decay=0.01)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    w, m, v = start.clone(), torch.zeros(6), torch.zeros(6)
    for k, g in enumerate(grads[1:], start=2):  # step 1 only counts
        if k <= 2:
            m.mul_(0.9).add_(g, alpha=0.1)
            v.mul_(0.999).addcmul_(g, g, value=0.001)
        else:
            m.mul_(0.9).add_(g, alpha=0.1)
        apply_update_(w, m, v, 0.1, 1e-8, 0.01)
    assert opt.owns_communication and not opt.bound
    assert torch.equal(p.detach(), w)


@pytest.mark.parametrize("name", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_deepspeeds_max_grad_norm_constructor_argument_is_accepted_and_ignored(name: str) -> None:
    """DeepSpeed 0.19.6's 1-bit constructors take ``max_grad_norm`` and never read it; in a config's
    ``optimizer.params`` DeepSpeed's engine refuses it (use ``gradient_clipping``), and so do we."""
    cls = {"OneBitAdam": OneBitAdam, "ZeroOneAdam": ZeroOneAdam, "OneBitLamb": OneBitLamb}[name]
    assert cls([torch.nn.Parameter(torch.zeros(2))], max_grad_norm=1.0).max_grad_norm == 1.0
    with pytest.raises(ConfigError, match="gradient_clipping"):
        validate_optimizer_params(name.lower(), {"lr": 1e-3, "max_grad_norm": 1.0})


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (OneBitAdam, {"freeze_step": 2}),
        (ZeroOneAdam, {"var_freeze_step": 3, "var_update_scaler": 1}),
        (OneBitLamb, {"freeze_step": 2}),
    ],
)
def test_frozen_parameters_take_no_part(cls, kwargs: dict) -> None:
    """A frozen ``nn.Parameter`` in the groups (LoRA: the engine hands every parameter over, as DeepSpeed's does)
    gets no state and never moves, weight decay on, through warm-up and the compressed phase; a plain tensor
    without ``requires_grad`` (the engine's fp32 masters) is still stepped."""
    g = torch.Generator().manual_seed(3)
    frozen = torch.nn.Parameter(torch.randn(5, generator=g), requires_grad=False)
    live = torch.nn.Parameter(torch.randn(6, generator=g))
    master = torch.randn(4, generator=g)  # a plain tensor, as a master weight
    start = [frozen.detach().clone(), live.detach().clone(), master.clone()]
    opt = cls([frozen, live, master], lr=0.01, weight_decay=0.1, **kwargs)
    for _ in range(6):
        live.grad, master.grad = torch.randn(6, generator=g), torch.randn(4, generator=g)
        opt.step()
    assert frozen not in opt.state and torch.equal(frozen.detach(), start[0])
    assert not torch.equal(live.detach(), start[1]) and not torch.equal(master, start[2])
