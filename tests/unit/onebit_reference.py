"""Shared by the 0/1 Adam and 1-bit LAMB unit tests: DeepSpeed 0.19.6's own classes run at world 1."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

DS0196_PYTHON = Path("/work/ds0196venv/bin/python")
RUNNER = Path(__file__).with_name("ds_onebit_runner.py")


def deepspeed_histories(tmp_path: Path, cases: list[dict]) -> list[dict]:
    """Per case (``name``, ``kwargs``, ``params``, ``grads``): the parameters after every step of DeepSpeed's
    class, all cases in one subprocess (skips when the 0.19.6 venv is absent)."""
    if not DS0196_PYTHON.exists():
        pytest.skip(f"DeepSpeed 0.19.6 venv absent ({DS0196_PYTHON}): no reference run")
    src, out = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(cases, src)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    done = subprocess.run(
        [str(DS0196_PYTHON), str(RUNNER), str(src), str(out)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, f"DeepSpeed reference failed:\n{done.stderr[-3000:]}"
    return torch.load(out)


def problem(seed: int, steps: int, shapes: tuple[tuple[int, ...], ...] = ((6, 5), (9,), (3, 4))) -> tuple:
    """Initial parameters and one gradient list per step (fixed seed)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(*s, generator=gen) for s in shapes]
    grads = [[torch.randn(*s, generator=gen) * (1 + i % 3) for i, s in enumerate(shapes)] for _ in range(steps)]
    return params, grads


def run_ours(
    opt_cls, kwargs: dict, params: list[torch.Tensor], grads: list[list[torch.Tensor]], first_step: bool = True
) -> tuple:
    """Our optimizer over the same problem: (history of parameters, history of lamb coefficients). With
    ``first_step``, a first step on a gradient that must not matter comes first, as in the DeepSpeed runner."""
    live = [torch.nn.Parameter(t.clone()) for t in params]
    opt = opt_cls(live, **kwargs)
    if first_step:
        for p in live:
            p.grad = torch.full_like(p, 123.0)
        opt.step()  # DeepSpeed's initialization step: states only
        assert all(torch.equal(p.detach(), t) for p, t in zip(live, params, strict=True))
    history, coeffs = [], []
    for step_grads in grads:
        for p, g in zip(live, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
        history.append([p.detach().clone() for p in live])
        coeffs.append(opt.get_lamb_coeffs() if hasattr(opt, "get_lamb_coeffs") else [])
    return history, coeffs
