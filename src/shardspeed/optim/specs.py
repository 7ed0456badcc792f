"""What each ``optimizer.type`` accepts in ``optimizer.params``, and its defaults.

DeepSpeed's "Adam" is AdamW
---------------------------
**In DeepSpeed's config, ``"type": "Adam"`` means decoupled weight decay (AdamW) unless the params say
``"adam_w_mode": false``.** We follow that: ``Adam`` builds ``torch.optim.AdamW`` by default and
``torch.optim.Adam`` (weight decay added to the gradient, i.e. L2) only with ``adam_w_mode: false``.
``"type": "AdamW"`` is always decoupled; ``adam_w_mode: false`` with it is refused as contradictory
(DeepSpeed silently ignores it).

DeepSpeed builds its fused Adam kernel, whose ``weight_decay`` default is 0 — unlike ``torch.optim.AdamW``'s
0.01 — so a config that leaves ``weight_decay`` out gets 0 here too. With ``"torch_adam": true`` DeepSpeed
calls the torch class with torch's defaults, and so do we (AdamW then defaults to 0.01).

Accepted-and-ignored DeepSpeed keys: ``torch_adam`` (we always run torch's Adam/AdamW; the flag only picks
the weight-decay default above), ``set_grad_none`` (torch already zeroes grads to None). ``bias_correction:
false`` builds ``shardspeed.ops.adam.FusedAdam`` with bias correction off (torch's Adam always corrects).
``fused``/``foreach``/``capturable``/``maximize``/
``differentiable`` are torch's own keys and are passed through: fused/foreach pick a kernel, not different
math. ``max_grad_norm`` is refused for every type: clipping is the top-level ``gradient_clipping`` key.

Other types: ``Lamb`` and ``Lion`` are our own implementations with DeepSpeed's parameter names and
defaults (``shardspeed.optim.lamb`` / ``.lion``). Any other name is a ``torch.optim`` class: its keys are the
constructor's keyword arguments, torch's own defaults apply (not filled in here), and the values are
additionally checked by constructing the class once on a 1-element dummy tensor, so torch's own range
errors surface at config-parse time with the key path attached.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from shardspeed.config.errors import ConfigError
from shardspeed.optim.compressed_types import COMPRESSED_TYPES
from shardspeed.optim.names import canonical_optimizer_name, torch_optimizer_classes
from shardspeed.optim.param_checks import (
    ParamSpec,
    check_bool,
    check_number,
    check_number_tuple,
    optional,
    validate_params,
)

_non_negative = partial(check_number, minimum=0.0)
_positive = partial(check_number, minimum=0.0, exclusive_minimum=True)
_adam_betas = partial(check_number_tuple, length=2, minimum=0.0, maximum=1.0, exclusive_maximum=True)
_lion_betas = partial(check_number_tuple, length=2, minimum=0.0, maximum=1.0)


def _must_be(expected: bool, why: str) -> Any:
    """A bool check that only accepts ``expected`` (a DeepSpeed switch whose other side we lack)."""

    def check(value: Any, path: str) -> bool:
        value = check_bool(value, path)
        if value is not expected:
            raise ConfigError(f"{path}={str(value).lower()} is not supported: {why}")
        return value

    return check


_TORCH_PASSTHROUGH = {
    "foreach": ParamSpec(optional(check_bool)),
    "fused": ParamSpec(optional(check_bool)),
    "capturable": ParamSpec(check_bool),
    "maximize": ParamSpec(check_bool),
    "differentiable": ParamSpec(check_bool),
}

ADAM_SPEC: dict[str, ParamSpec] = {
    "lr": ParamSpec(_non_negative, 1e-3),
    "betas": ParamSpec(_adam_betas, (0.9, 0.999)),
    "eps": ParamSpec(_non_negative, 1e-8),
    "weight_decay": ParamSpec(_non_negative),  # default depends on torch_adam, resolved below
    "amsgrad": ParamSpec(check_bool, False),
    "adam_w_mode": ParamSpec(check_bool),  # default depends on the type name, resolved below
    "bias_correction": ParamSpec(check_bool),  # false -> FusedAdam (build.py); true is torch's Adam/AdamW
    "torch_adam": ParamSpec(check_bool),
    "set_grad_none": ParamSpec(check_bool),
    **_TORCH_PASSTHROUGH,
}

LAMB_SPEC: dict[str, ParamSpec] = {
    "lr": ParamSpec(_non_negative, 1e-3),
    "betas": ParamSpec(_adam_betas, (0.9, 0.999)),
    "eps": ParamSpec(_non_negative, 1e-8),
    "weight_decay": ParamSpec(_non_negative, 0.0),
    "bias_correction": ParamSpec(check_bool, True),
    "eps_inside_sqrt": ParamSpec(check_bool, False),
    "max_coeff": ParamSpec(_positive, 10.0),
    "min_coeff": ParamSpec(_positive, 0.01),
    "amsgrad": ParamSpec(_must_be(False, "LAMB has no AMSGrad variant (DeepSpeed refuses it too)")),
}

LION_SPEC: dict[str, ParamSpec] = {
    "lr": ParamSpec(_non_negative, 1e-3),
    "betas": ParamSpec(_lion_betas, (0.9, 0.99)),
    "weight_decay": ParamSpec(_non_negative, 0.0),
}

_KEY_HINTS: dict[str, str] = {
    "max_grad_norm": (
        "gradient clipping is not an optimizer parameter; use the top-level "
        '"gradient_clipping" key (DeepSpeed refuses max_grad_norm here too)'
    ),
}
_ADAM_KEY_HINTS: dict[str, str] = {
    "decoupled_weight_decay": 'use "adam_w_mode" (true = decoupled/AdamW, false = L2/Adam)',
}


def _check_for_torch_default(default: Any) -> ParamSpec:
    """Infer a value check for a torch constructor argument from its default value."""
    if isinstance(default, bool):
        return ParamSpec(check_bool)
    if isinstance(default, (int, float)):
        return ParamSpec(check_number)
    if isinstance(default, tuple):
        allow_none = any(item is None for item in default)
        return ParamSpec(partial(check_number_tuple, length=len(default), allow_none=allow_none))
    # None or str defaults (foreach, line_search_fn, ...): torch's constructor checks them.
    return ParamSpec(lambda value, path: value)


def torch_class_spec(cls: type[torch.optim.Optimizer]) -> dict[str, ParamSpec]:
    """The accepted keys of a torch optimizer: its constructor's keyword arguments."""
    spec: dict[str, ParamSpec] = {}
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        if name in ("self", "params") or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        spec[name] = _check_for_torch_default(parameter.default)
    return spec


def _refuse_hinted_keys(params: Mapping[str, Any], hints: Mapping[str, str], path: str) -> None:
    for key, hint in hints.items():
        if key in params:
            raise ConfigError(f"{path}.{key} is not accepted: {hint}")


def _normalize_adam(type_name: str, params: dict[str, Any], path: str) -> dict[str, Any]:
    if type_name == "AdamW" and params.get("adam_w_mode") is False:
        raise ConfigError(
            f'{path}.adam_w_mode=false contradicts type "AdamW" (always decoupled weight decay); '
            'use type "Adam" with adam_w_mode=false for L2-style weight decay'
        )
    adam_w_mode = params.pop("adam_w_mode", True)
    torch_adam = params.pop("torch_adam", False)
    params.pop("set_grad_none", None)
    if params.pop("bias_correction", True) is False:
        # torch's Adam/AdamW cannot switch bias correction off; shardspeed.ops.adam.FusedAdam (same update,
        # DeepSpeed's constructor) can, but takes none of torch's kernel keys nor AMSGrad (as in DeepSpeed).
        torch_only = sorted(key for key in (*_TORCH_PASSTHROUGH, "amsgrad") if params.get(key) not in (None, False))
        if torch_only or torch_adam:
            culprit = ", ".join(f"{path}.{key}" for key in torch_only) or f"{path}.torch_adam"
            raise ConfigError(
                f"{path}.bias_correction=false builds shardspeed.ops.adam.FusedAdam, which does not take {culprit}; "
                "remove it or keep bias_correction true"
            )
        for key in (*_TORCH_PASSTHROUGH, "amsgrad"):
            params.pop(key, None)
        params["bias_correction"] = False
    if "weight_decay" not in params:
        params["weight_decay"] = 0.01 if (torch_adam and adam_w_mode) else 0.0
    params["adam_w_mode"] = adam_w_mode
    return params


def _check_with_torch(cls: type[torch.optim.Optimizer], params: dict[str, Any], path: str) -> None:
    """Let torch's constructor range-check the values now, on a dummy tensor, instead of at build time."""
    device_dependent = ("fused", "foreach", "capturable")  # valid or not depending on where params live
    kwargs = {key: value for key, value in params.items() if key not in device_dependent}
    try:
        cls([torch.zeros(1, requires_grad=True)], **kwargs)
    except (ValueError, TypeError, RuntimeError) as err:
        raise ConfigError(f"{path}: torch.optim.{cls.__name__} rejected {kwargs}: {err}") from err


def validate_optimizer_params(type_name: str, params: dict[str, Any], path: str = "optimizer.params") -> dict:
    """Check ``params`` for optimizer ``type_name`` and return them normalized.

    ``type_name`` is matched case-insensitively (see ``shardspeed.optim.names``). The result uses canonical
    keys only, tuples for pairs, floats for numbers, and — for Adam, AdamW, Lamb and Lion — every default
    filled in, so what is logged is what runs. Adam/AdamW results always carry ``adam_w_mode``; note that
    **DeepSpeed's "Adam" defaults to adam_w_mode=True, i.e. it is AdamW** (module docstring). Validating an
    already-normalized dict returns it unchanged. Raises ConfigError naming ``f"{path}.{key}"``.
    """
    type_path = path[: -len(".params")] + ".type" if path.endswith(".params") else f"{path}.type"
    name = canonical_optimizer_name(type_name, type_path)
    raw = {} if params is None else params
    if isinstance(raw, Mapping):
        _refuse_hinted_keys(raw, _KEY_HINTS, path)
        if name in ("Adam", "AdamW"):
            _refuse_hinted_keys(raw, _ADAM_KEY_HINTS, path)
    if name in ("Adam", "AdamW"):
        return _normalize_adam(name, validate_params(raw, ADAM_SPEC, path), path)
    if name == "Lamb":
        normalized = validate_params(raw, LAMB_SPEC, path)
        normalized.pop("amsgrad", None)
        if normalized["min_coeff"] > normalized["max_coeff"]:
            raise ConfigError(
                f"{path}.min_coeff ({normalized['min_coeff']}) must be <= {path}.max_coeff ({normalized['max_coeff']})"
            )
        return normalized
    if name == "Lion":
        return validate_params(raw, LION_SPEC, path)
    if name in COMPRESSED_TYPES:
        return validate_params(raw, COMPRESSED_TYPES[name].spec, path)
    cls = torch_optimizer_classes()[name]
    normalized = validate_params(raw, torch_class_spec(cls), path)
    _check_with_torch(cls, normalized, path)
    return normalized
