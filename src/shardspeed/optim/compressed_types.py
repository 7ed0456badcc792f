"""The communication-compressed optimizer types a config may name (DeepSpeed's 1-bit optimizers): their
``optimizer.params`` specs and where their classes live (imported only when built).

Each entry is DeepSpeed's spelling, its parameter spec (DeepSpeed's constructor arguments and defaults) and the
class's import path. ``names.py`` lists the names, ``specs.py`` validates with the spec, ``build.py`` builds the
class: adding a type is one entry here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import partial
from typing import Any

from shardspeed.optim.param_checks import (
    ParamSpec,
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_number_tuple,
)

_non_negative = partial(check_number, minimum=0.0)
_positive = partial(check_number, minimum=0.0, exclusive_minimum=True)
_betas = partial(check_number_tuple, length=2, minimum=0.0, maximum=1.0, exclusive_maximum=True)
_backend = partial(check_choice, choices=("nccl", "mpi", "hccl", "compressed"))


def _no_amsgrad(value: Any, path: str) -> bool:
    value = check_bool(value, path)
    if value:
        from shardspeed.config.errors import ConfigError

        raise ConfigError(f"{path}=true is not supported: 1-bit optimizers have no AMSGrad variant (nor has DeepSpeed)")
    return value


_COMMON: dict[str, ParamSpec] = {
    # accepted as in DeepSpeed: the backend is the process group's whatever the name (onebit_adam.py)
    "cuda_aware": ParamSpec(check_bool, False),
    "comm_backend_name": ParamSpec(_backend, "nccl"),
}


@dataclass(frozen=True)
class CompressedType:
    spec: dict[str, ParamSpec]
    cls_path: str  # "module:Class"

    def cls(self) -> type:
        module, _, name = self.cls_path.partition(":")
        return getattr(importlib.import_module(module), name)


COMPRESSED_TYPES: dict[str, CompressedType] = {
    "OneBitAdam": CompressedType(
        {
            "lr": ParamSpec(_non_negative, 1e-3),
            "freeze_step": ParamSpec(partial(check_int, minimum=0), 100000),
            "betas": ParamSpec(_betas, (0.9, 0.999)),
            "eps": ParamSpec(_non_negative, 1e-8),
            "weight_decay": ParamSpec(_non_negative, 0.0),
            "bias_correction": ParamSpec(check_bool, True),  # DeepSpeed's OnebitAdam ignores it (no correction)
            "eps_inside_sqrt": ParamSpec(check_bool, False),  # ignored there too
            "amsgrad": ParamSpec(_no_amsgrad, False),
            **_COMMON,
        },
        "shardspeed.compression.onebit_adam:OneBitAdam",
    ),
    "ZeroOneAdam": CompressedType(
        {
            "lr": ParamSpec(_non_negative, 1e-3),
            "betas": ParamSpec(_betas, (0.9, 0.999)),
            "eps": ParamSpec(_non_negative, 1e-8),
            "weight_decay": ParamSpec(_non_negative, 0.0),
            "var_freeze_step": ParamSpec(partial(check_int, minimum=0), 100000),
            "var_update_scaler": ParamSpec(partial(check_int, minimum=1), 16),
            "local_step_scaler": ParamSpec(partial(check_int, minimum=1), 32678),
            "local_step_clipper": ParamSpec(partial(check_int, minimum=1), 16),
            "bias_correction": ParamSpec(check_bool, True),  # DeepSpeed's ZeroOneAdam ignores it (no correction)
            "eps_inside_sqrt": ParamSpec(check_bool, False),  # ignored there too
            "amsgrad": ParamSpec(_no_amsgrad, False),
            **_COMMON,
        },
        "shardspeed.compression.zero_one_adam:ZeroOneAdam",
    ),
    "OneBitLamb": CompressedType(
        {
            "lr": ParamSpec(_non_negative, 1e-3),
            "freeze_step": ParamSpec(partial(check_int, minimum=0), 100000),
            "betas": ParamSpec(_betas, (0.9, 0.999)),
            "eps": ParamSpec(_non_negative, 1e-8),
            "weight_decay": ParamSpec(_non_negative, 0.0),
            "max_coeff": ParamSpec(_positive, 10.0),
            "min_coeff": ParamSpec(_positive, 0.01),
            "coeff_beta": ParamSpec(partial(check_number, minimum=0.0, maximum=1.0, exclusive_maximum=True), 0.9),
            "factor_max": ParamSpec(_positive, 4.0),
            "factor_min": ParamSpec(_positive, 0.5),
            "factor_threshold": ParamSpec(_non_negative, 0.1),
            "bias_correction": ParamSpec(check_bool, True),  # DeepSpeed's OnebitLamb ignores it (no correction)
            "eps_inside_sqrt": ParamSpec(check_bool, False),  # ignored there too
            "amsgrad": ParamSpec(_no_amsgrad, False),
            **_COMMON,
        },
        "shardspeed.compression.onebit_lamb:OneBitLamb",
    ),
}
"""DeepSpeed's compressed optimizer types by canonical name."""
