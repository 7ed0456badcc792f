"""Optimizer construction from DeepSpeed-style config, and the Lamb / Lion update rules.

Expected numbers are computed here from the published formulas with plain Python floats, not by calling
the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardspeed.config.errors import ConfigError
from shardspeed.optim import (
    Lamb,
    Lion,
    build_optimizer,
    canonical_optimizer_name,
    is_elementwise,
    validate_optimizer_params,
)


def _params(*values: list[float]) -> list[torch.Tensor]:
    return [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in values]


def _one_step(optimizer: torch.optim.Optimizer, grads: list[list[float]]) -> None:
    for group in optimizer.param_groups:
        for param, grad in zip(group["params"], grads):
            param.grad = torch.tensor(grad, dtype=param.dtype)
    optimizer.step()


# ---------------------------------------------------------------- which class, which hyperparameters


def test_adam_defaults_to_decoupled_weight_decay_with_deepspeed_defaults() -> None:
    optimizer = build_optimizer("Adam", {"lr": 3e-4}, _params([1.0]))
    assert type(optimizer) is torch.optim.AdamW
    defaults = optimizer.defaults
    assert defaults["lr"] == 3e-4
    assert defaults["betas"] == (0.9, 0.999)
    assert defaults["eps"] == 1e-8
    # DeepSpeed's fused Adam defaults weight_decay to 0, unlike torch.optim.AdamW's 0.01.
    assert defaults["weight_decay"] == 0.0
    assert defaults["amsgrad"] is False


def test_adam_with_adam_w_mode_false_is_l2_adam() -> None:
    optimizer = build_optimizer("adam", {"adam_w_mode": False, "weight_decay": 0.1}, _params([1.0]))
    assert type(optimizer) is torch.optim.Adam
    assert optimizer.defaults["weight_decay"] == 0.1
    assert optimizer.defaults.get("decoupled_weight_decay", False) is False


@pytest.mark.parametrize("spelling", ["AdamW", "adamw", "ADAMW"])
def test_adamw_any_case(spelling: str) -> None:
    optimizer = build_optimizer(spelling, {"betas": [0.8, 0.95], "eps": 1e-6}, _params([1.0]))
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["betas"] == (0.8, 0.95)
    assert optimizer.defaults["eps"] == 1e-6
    assert optimizer.defaults["weight_decay"] == 0.0


def test_torch_adam_uses_torch_defaults() -> None:
    optimizer = build_optimizer("AdamW", {"torch_adam": True}, _params([1.0]))
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["weight_decay"] == 0.01


def test_lamb_and_lion_defaults() -> None:
    lamb = build_optimizer("Lamb", {"lr": 0.01}, _params([1.0]))
    assert type(lamb) is Lamb
    assert lamb.defaults["lr"] == 0.01
    assert lamb.defaults["max_coeff"] == 10.0
    assert lamb.defaults["min_coeff"] == 0.01
    assert lamb.defaults["betas"] == (0.9, 0.999)
    assert lamb.defaults["bias_correction"] is True
    lion = build_optimizer("lion", {}, _params([1.0]))
    assert type(lion) is Lion
    assert lion.defaults == {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.0}


@pytest.mark.parametrize(
    ("type_name", "cls", "params"),
    [
        ("SGD", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        ("sgd", torch.optim.SGD, {"lr": 0.2}),
        ("Adagrad", torch.optim.Adagrad, {"lr": 0.05, "lr_decay": 0.001}),
        ("RMSprop", torch.optim.RMSprop, {"lr": 0.01, "alpha": 0.9, "centered": True}),
        ("Adamax", torch.optim.Adamax, {"lr": 0.002, "betas": [0.8, 0.9]}),
        ("NAdam", torch.optim.NAdam, {"lr": 0.002, "momentum_decay": 0.005}),
        ("RAdam", torch.optim.RAdam, {"lr": 0.001, "weight_decay": 0.1}),
        ("Adadelta", torch.optim.Adadelta, {"lr": 1.0, "rho": 0.8}),
        ("ASGD", torch.optim.ASGD, {"lr": 0.01, "lambd": 0.001}),
        ("Rprop", torch.optim.Rprop, {"lr": 0.01, "etas": [0.4, 1.3]}),
    ],
)
def test_torch_optim_classes_by_name(type_name: str, cls: type, params: dict) -> None:
    optimizer = build_optimizer(type_name, params, _params([1.0, 2.0]))
    assert type(optimizer) is cls
    for key, value in params.items():
        expected = tuple(value) if isinstance(value, list) else value
        assert optimizer.defaults[key] == expected, key


def test_param_groups_are_kept_and_group_keys_override_config() -> None:
    first, second = _params([1.0], [2.0])
    groups = [{"params": [first], "lr": 0.5, "weight_decay": 0.1}, {"params": [second]}]
    optimizer = build_optimizer("AdamW", {"lr": 0.01}, groups)
    assert len(optimizer.param_groups) == 2
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert optimizer.param_groups[0]["weight_decay"] == 0.1
    assert optimizer.param_groups[1]["lr"] == 0.01
    assert optimizer.param_groups[1]["weight_decay"] == 0.0
    assert optimizer.param_groups[1]["params"][0] is second


def test_parameters_from_a_generator() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer("SGD", {"lr": 0.1}, model.parameters())
    assert len(optimizer.param_groups[0]["params"]) == 2


# ---------------------------------------------------------------- user optimizers


def test_user_optimizer_instance_is_returned_as_is() -> None:
    params = _params([1.0])
    mine = torch.optim.SGD(params, lr=0.3)
    assert build_optimizer(None, None, params, user_optimizer=mine) is mine


def test_user_optimizer_callable_gets_the_parameter_list() -> None:
    params = _params([1.0], [2.0])
    seen: list[list[torch.Tensor]] = []

    def factory(received: list) -> torch.optim.Optimizer:
        seen.append(received)
        return torch.optim.SGD(received, lr=0.3)

    optimizer = build_optimizer(None, None, iter(params), user_optimizer=factory)
    assert isinstance(optimizer, torch.optim.SGD)
    assert isinstance(seen[0], list) and len(seen[0]) == 2


def test_user_callable_returning_non_optimizer() -> None:
    with pytest.raises(TypeError, match=r"expected a torch\.optim\.Optimizer"):
        build_optimizer(None, None, _params([1.0]), user_optimizer=lambda params: "not an optimizer")


def test_no_optimizer_at_all() -> None:
    with pytest.raises(ValueError, match="no optimizer"):
        build_optimizer(None, None, _params([1.0]))


def test_empty_parameters() -> None:
    with pytest.raises(ValueError, match="empty"):
        build_optimizer("Adam", {}, [])


# ---------------------------------------------------------------- numerics: adam_w_mode


def test_adam_w_mode_step_matches_decoupled_and_l2_formulas() -> None:
    lr, wd, eps = 0.1, 0.5, 1e-8
    w0, g = [1.0, -2.0], [0.3, 0.4]
    decoupled = build_optimizer("Adam", {"lr": lr, "weight_decay": wd, "eps": eps}, _params(w0))
    l2 = build_optimizer("Adam", {"lr": lr, "weight_decay": wd, "eps": eps, "adam_w_mode": False}, _params(w0))
    _one_step(decoupled, [g])
    _one_step(l2, [g])
    # Step 1 of Adam: bias-corrected m_hat = g', v_hat = g'^2, so the update is lr * g' / (|g'| + eps).
    expected_decoupled = [w * (1 - lr * wd) - lr * gi / (abs(gi) + eps) for w, gi in zip(w0, g)]
    g_l2 = [gi + wd * w for w, gi in zip(w0, g)]
    expected_l2 = [w - lr * gi / (abs(gi) + eps) for w, gi in zip(w0, g_l2)]
    assert decoupled.param_groups[0]["params"][0].tolist() == pytest.approx(expected_decoupled, rel=1e-12)
    assert l2.param_groups[0]["params"][0].tolist() == pytest.approx(expected_l2, rel=1e-12)
    assert expected_decoupled != pytest.approx(expected_l2)

    reference_adamw = torch.optim.AdamW(_params(w0), lr=lr, weight_decay=wd, eps=eps)
    reference_adam = torch.optim.Adam(_params(w0), lr=lr, weight_decay=wd, eps=eps)
    _one_step(reference_adamw, [g])
    _one_step(reference_adam, [g])
    assert torch.equal(decoupled.param_groups[0]["params"][0], reference_adamw.param_groups[0]["params"][0])
    assert torch.equal(l2.param_groups[0]["params"][0], reference_adam.param_groups[0]["params"][0])


# ---------------------------------------------------------------- numerics: Lamb


def _lamb_reference(
    w: list[float],
    grads: list[list[float]],
    lr: float,
    b1: float,
    b2: float,
    eps: float,
    wd: float,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
) -> list[float]:
    """You et al. 2019, Algorithm 2, one tensor, plain floats."""
    m = [0.0] * len(w)
    v = [0.0] * len(w)
    w = list(w)
    for t, g in enumerate(grads, start=1):
        m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
        v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
        m_hat = [mi / (1 - b1**t) for mi in m]
        v_hat = [vi / (1 - b2**t) for vi in v]
        r = [mh / (math.sqrt(vh) + eps) + wd * wi for mh, vh, wi in zip(m_hat, v_hat, w)]
        w_norm = math.sqrt(sum(x * x for x in w))
        r_norm = math.sqrt(sum(x * x for x in r))
        trust = min(max(w_norm / r_norm, min_coeff), max_coeff) if w_norm > 0 and r_norm > 0 else 1.0
        w = [wi - lr * trust * ri for wi, ri in zip(w, r)]
    return w


def test_lamb_matches_the_paper_over_two_steps() -> None:
    w0, grads = [1.0, -2.0, 0.5], [[0.5, 0.25, -1.0], [-0.1, 0.3, 0.2]]
    optimizer = Lamb(_params(w0), lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.01)
    for g in grads:
        _one_step(optimizer, [g])
    expected = _lamb_reference(w0, grads, lr=0.1, b1=0.8, b2=0.9, eps=1e-6, wd=0.01)
    assert optimizer.param_groups[0]["params"][0].tolist() == pytest.approx(expected, rel=1e-10)


def test_lamb_first_step_by_hand() -> None:
    # Step 1: m_hat = g, v_hat = g^2, r = sign(g) (eps=0) + wd*w = [1.01, 0.98] for w=[1,-2], wd=0.01.
    optimizer = Lamb(_params([1.0, -2.0]), lr=0.1, eps=0.0, weight_decay=0.01)
    _one_step(optimizer, [[0.5, 0.25]])
    r = [1.01, 1.0 - 0.02]
    trust = math.sqrt(5.0) / math.sqrt(r[0] ** 2 + r[1] ** 2)
    expected = [1.0 - 0.1 * trust * r[0], -2.0 - 0.1 * trust * r[1]]
    assert optimizer.param_groups[0]["params"][0].tolist() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("w0", "expected_trust"),
    [
        ([100.0, 0.0], 10.0),  # ||w|| / ||r|| = 100/sqrt(2) > max_coeff
        ([1e-4, 0.0], 0.01),  # ratio ~7e-5 < min_coeff
        ([0.0, 0.0], 1.0),  # zero weights: no ratio, plain step
    ],
)
def test_lamb_trust_ratio_is_clamped(w0: list[float], expected_trust: float) -> None:
    optimizer = Lamb(_params(w0), lr=0.1, eps=0.0)
    _one_step(optimizer, [[1.0, -1.0]])  # r = sign(g) = [1, -1]
    expected = [w0[0] - 0.1 * expected_trust, w0[1] + 0.1 * expected_trust]
    assert optimizer.param_groups[0]["params"][0].tolist() == pytest.approx(expected, rel=1e-12)


def test_lamb_and_lion_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="min_coeff"):
        Lamb(_params([1.0]), min_coeff=2.0, max_coeff=1.0)
    with pytest.raises(ValueError, match="lr"):
        Lion(_params([1.0]), lr=-1.0)


# ---------------------------------------------------------------- numerics: Lion


def test_lion_two_steps_by_hand() -> None:
    lr, wd, b1, b2 = 0.1, 0.5, 0.9, 0.99
    w0, g1, g2 = [1.0, -2.0, 0.5], [0.5, -0.25, 0.0], [-0.01, 0.01, 0.0]
    optimizer = build_optimizer("Lion", {"lr": lr, "weight_decay": wd, "betas": [b1, b2]}, _params(w0))
    _one_step(optimizer, [g1])
    # Step 1: momentum is 0, so the direction is sign(g1) = [1, -1, 0].
    w1 = [w * (1 - lr * wd) - lr * s for w, s in zip(w0, [1.0, -1.0, 0.0])]
    assert optimizer.param_groups[0]["params"][0].tolist() == pytest.approx(w1, rel=1e-12)
    _one_step(optimizer, [g2])
    # Step 2: m1 = 0.01*g1 = [0.005, -0.0025, 0]; c = 0.9*m1 + 0.1*g2 = [0.0035, -0.00125, 0]:
    # the momentum outvotes the small opposite gradient, so the direction is still [1, -1, 0].
    m1 = [(1 - b2) * g for g in g1]
    c = [b1 * m + (1 - b1) * g for m, g in zip(m1, g2)]
    assert c == pytest.approx([0.0035, -0.00125, 0.0])
    w2 = [w * (1 - lr * wd) - lr * s for w, s in zip(w1, [1.0, -1.0, 0.0])]
    assert optimizer.param_groups[0]["params"][0].tolist() == pytest.approx(w2, rel=1e-12)
    m2 = [b2 * m + (1 - b2) * g for m, g in zip(m1, g2)]
    state = optimizer.state[optimizer.param_groups[0]["params"][0]]
    assert state["exp_avg"].tolist() == pytest.approx(m2, rel=1e-12)


# ---------------------------------------------------------------- element-wise flag


def test_is_elementwise() -> None:
    params = _params([1.0])
    for optimizer in (
        build_optimizer("Adam", {}, params),
        build_optimizer("SGD", {"lr": 0.1}, params),
        build_optimizer("Adagrad", {}, params),
        build_optimizer("Lion", {}, params),
        build_optimizer("RMSprop", {}, params),
        build_optimizer("Adamax", {}, params),
    ):
        assert is_elementwise(optimizer), type(optimizer).__name__
    assert not is_elementwise(build_optimizer("Lamb", {}, params))
    assert not is_elementwise(build_optimizer("Adafactor", {}, params))

    class MyAdam(torch.optim.Adam):
        pass

    assert not is_elementwise(MyAdam(params))
    assert is_elementwise(torch.optim.AdamW) and not is_elementwise(Lamb)


# ---------------------------------------------------------------- validation and its messages


def test_validate_normalizes_and_is_idempotent() -> None:
    normalized = validate_optimizer_params("adam", {"lr": 1, "betas": [0.8, 0.99], "torch_adam": False})
    assert normalized == {
        "lr": 1.0,
        "betas": (0.8, 0.99),
        "eps": 1e-8,
        "weight_decay": 0.0,
        "amsgrad": False,
        "adam_w_mode": True,
    }
    assert validate_optimizer_params("Adam", normalized) == normalized
    lamb = validate_optimizer_params("Lamb", {})
    assert validate_optimizer_params("Lamb", lamb) == lamb
    assert canonical_optimizer_name("rmsprop") == "RMSprop"


@pytest.mark.parametrize(
    ("type_name", "params", "pattern"),
    [
        ("Adamm", {}, r'optimizer\.type "Adamm" is not a known optimizer \(did you mean "Adam"\?\)'),
        ("MuAdamW", {}, r"MuAdamW is not supported yet"),
        ("LBFGS", {}, r"closure"),
        (3, {}, r"optimizer\.type must be a string"),
        ("Adam", {"lrr": 0.1}, r'optimizer\.params\.lrr is not a known parameter \(did you mean "lr"\?\)'),
        ("Adam", {"lr": "0.1"}, r"optimizer\.params\.lr must be a number, got '0\.1'"),
        ("Adam", {"lr": True}, r"optimizer\.params\.lr must be a number, got True"),
        ("Adam", {"lr": -1}, r"optimizer\.params\.lr must be >= 0"),
        ("AdamW", {"lr": "auto"}, r"optimizer\.params\.lr.*\"auto\".*Hugging Face"),
        ("Adam", {"betas": [0.9]}, r"optimizer\.params\.betas must be a list of 2 numbers"),
        ("Adam", {"betas": [0.9, 1.0]}, r"optimizer\.params\.betas\[1\] must be >= 0\.0 and < 1\.0"),
        ("Adam", {"amsgrad": "yes"}, r"optimizer\.params\.amsgrad must be true or false, got 'yes'"),
        ("Adam", {"max_grad_norm": 1.0}, r"optimizer\.params\.max_grad_norm.*gradient_clipping"),
        ("AdamW", {"adam_w_mode": False}, r"adam_w_mode=false contradicts type \"AdamW\""),
        ("Adam", {"bias_correction": False, "amsgrad": True}, r"bias_correction=false .*FusedAdam.*params\.amsgrad"),
        ("Adam", {"decoupled_weight_decay": True}, r"adam_w_mode"),
        ("Lamb", {"amsgrad": True}, r"optimizer\.params\.amsgrad=true is not supported"),
        ("Lamb", {"min_coeff": 5.0, "max_coeff": 1.0}, r"min_coeff .* must be <="),
        ("Lion", {"eps": 1e-8}, r"optimizer\.params\.eps is not a known parameter"),
        ("SGD", {"momentun": 0.9}, r'optimizer\.params\.momentun .*did you mean "momentum"'),
        ("SGD", {"lr": 0.1, "nesterov": True}, r"optimizer\.params: torch\.optim\.SGD rejected.*Nesterov"),
        ("RMSprop", {"alpha": -0.5}, r"torch\.optim\.RMSprop rejected.*alpha"),
        ("Adam", [1, 2], r"optimizer\.params must be a JSON object"),
    ],
)
def test_validation_errors_name_the_culprit(type_name: object, params: object, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        validate_optimizer_params(type_name, params)  # type: ignore[arg-type]


def test_validation_uses_the_given_path() -> None:
    with pytest.raises(ConfigError, match=r"zero\.optimizer\.params\.lrr"):
        validate_optimizer_params("Adam", {"lrr": 1}, path="zero.optimizer.params")
    with pytest.raises(ConfigError, match=r"zero\.optimizer\.type"):
        validate_optimizer_params("Nope", {}, path="zero.optimizer.params")


# ---------------------------------------------------------------- which kernel ([Note: fused Adam by default])


def test_config_adam_runs_torchs_fused_kernel_and_matches_the_per_tensor_loop() -> None:
    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32)]
    built = [t.clone().requires_grad_() for t in start]
    reference = [t.clone().requires_grad_() for t in start]
    optimizer = build_optimizer("AdamW", {"lr": 1e-2}, built)
    loop = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.0, foreach=False)  # the config default
    assert optimizer.defaults["fused"] is True
    for step in range(5):
        for a, b in zip(built, reference):
            a.grad = b.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(step))
        optimizer.step()
        loop.step()
    for a, b in zip(built, reference):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("choice", [{"fused": False}, {"foreach": True}, {"foreach": False}])
def test_a_kernel_chosen_in_the_config_is_kept(choice: dict) -> None:
    optimizer = build_optimizer("Adam", {"lr": 1e-3, **choice}, _params([1.0]))
    assert not optimizer.defaults.get("fused")


def test_no_fused_kernel_for_integer_or_generator_groups_falls_back_to_torchs_default() -> None:
    generator_group = [{"params": (p for p in _params([1.0]))}]
    assert not build_optimizer("Adam", {"lr": 1e-3}, generator_group).defaults.get("fused")
    complex_param = [torch.zeros(2, dtype=torch.complex64, requires_grad=True)]
    assert not build_optimizer("Adam", {"lr": 1e-3}, complex_param).defaults.get("fused")
