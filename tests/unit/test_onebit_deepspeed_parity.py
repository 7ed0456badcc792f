"""ZeroOneAdam and OneBitLamb against DeepSpeed 0.19.6's own classes, at world 1, within 1e-6.

All cases run in one DeepSpeed subprocess (importing DeepSpeed dominates the time). At world 1 every
collective is skipped by DeepSpeed and is the identity for us, so what is compared is the optimizer math:
0/1 Adam's variance steps and its local phase with syncs at growing intervals; 1-bit LAMB's warm-up (trust
ratios, coefficient EMA, the fresh variance snapshot) and its compression stage (scaling coefficients,
reconstructed gradients, the clamped factor). One known world-1 difference is kept out of the cases: DeepSpeed
skips 0/1 Adam's momentum update on compressed steps when its world size is 1 (``var_update_scaler=100`` keeps
every pre-freeze step a variance step).
"""

from __future__ import annotations

import pytest
import torch
from onebit_reference import deepspeed_histories, problem, run_ours

from shardspeed.compression.onebit_lamb import OneBitLamb
from shardspeed.compression.zero_one_adam import ZeroOneAdam

CASES = [
    ("ZeroOneAdam", {"lr": 0.01, "var_freeze_step": 6, "var_update_scaler": 100, "local_step_scaler": 2,
                     "local_step_clipper": 4}),
    ("ZeroOneAdam", {"lr": 0.003, "weight_decay": 0.1, "betas": (0.8, 0.99), "var_freeze_step": 30,
                     "var_update_scaler": 100}),
    ("ZeroOneAdam", {"lr": 0.01, "eps": 1e-3, "var_freeze_step": 3, "local_step_scaler": 1, "local_step_clipper": 8}),
    ("OneBitLamb", {"lr": 0.01, "freeze_step": 5}),
    ("OneBitLamb", {"lr": 0.02, "freeze_step": 4, "weight_decay": 0.05, "coeff_beta": 0.5, "factor_threshold": 0.3}),
    ("OneBitLamb", {"lr": 0.01, "freeze_step": 8, "max_coeff": 0.5, "min_coeff": 0.1, "factor_max": 1.5,
                    "factor_min": 0.9}),
]  # fmt: skip
STEPS = 14
OURS = {"ZeroOneAdam": ZeroOneAdam, "OneBitLamb": OneBitLamb}


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory) -> list[dict]:
    cases = []
    for seed, (name, kwargs) in enumerate(CASES):
        params, grads = problem(seed, STEPS)
        ds_name = "OnebitLamb" if name == "OneBitLamb" else name
        cases.append({"name": ds_name, "kwargs": kwargs, "params": params, "grads": grads})
    return deepspeed_histories(tmp_path_factory.mktemp("ds0196"), cases)


@pytest.mark.slow  # the DeepSpeed subprocess: importing DeepSpeed alone takes ~10 s of CPU
@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_matches_deepspeed_at_world_1(deepspeed_runs, index: int) -> None:
    name, kwargs = CASES[index]
    params, grads = problem(index, STEPS)
    ours, coeffs = run_ours(OURS[name], kwargs, params, grads)
    reference = deepspeed_runs[index]
    for step, (want, got) in enumerate(zip(reference["history"], ours, strict=True)):
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6, msg=lambda m, s=step: f"step {s + 1}: {m}")
    if name == "OneBitLamb":
        for want, got in zip(reference["coeffs"], coeffs, strict=True):
            assert got == pytest.approx(want, rel=1e-5)
        assert any(c != 1.0 for step in coeffs for c in step)  # the coefficients did something
