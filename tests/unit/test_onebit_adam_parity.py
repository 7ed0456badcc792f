"""OneBitAdam's warm-up equals DeepSpeed 0.19.6's own ``OnebitAdam`` (run from /work/ds0196venv in a subprocess;
its unused communication backend stubbed: ds_onebit_adam_ref.py). Skipped where that venv is absent (CI): then
test_onebit_adam.py pins the same formula from DeepSpeed's source."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from shardspeed.compression.onebit_adam import OneBitAdam

DS_PYTHON = Path(os.environ.get("SHARDSPEED_DS0196_PYTHON", "/work/ds0196venv/bin/python"))
SCRIPT = Path(__file__).with_name("ds_onebit_adam_ref.py")


def _ours(params: list[torch.Tensor], grads: list[list[torch.Tensor]], hyper: list[float]) -> dict[str, torch.Tensor]:
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    lr, b1, b2, eps, wd, freeze = hyper
    opt = OneBitAdam(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, freeze_step=int(freeze))
    for step in grads:
        for p, g in zip(ps, step):
            p.grad = g.clone()
        opt.step()
        assert not opt.owns_communication  # warm-up only: no compressor, no binding needed
    out = {f"param{i}": p.detach() for i, p in enumerate(ps)}
    for i, p in enumerate(ps):
        out[f"exp_avg{i}"] = opt.state[p]["exp_avg"]
        out[f"exp_avg_sq{i}"] = opt.state[p]["exp_avg_sq"]
    return out


@pytest.mark.slow  # importing DeepSpeed takes ~30 s on a loaded machine
@pytest.mark.skipif(not DS_PYTHON.exists(), reason=f"DeepSpeed 0.19.6 venv absent ({DS_PYTHON})")
def test_warmup_equals_deepspeed_onebit_adam(tmp_path: Path) -> None:
    weight_decay = 0.01
    torch.manual_seed(0)
    params = [torch.randn(5, 3), torch.randn(7), torch.randn(())]
    grads = [[torch.randn_like(p) for p in params] for _ in range(6)]
    hyper = [1e-2, 0.9, 0.999, 1e-8, weight_decay, 100.0]
    data = {"params": params, "grads": grads, "hyper": torch.tensor(hyper, dtype=torch.float64)}
    torch.save(data, tmp_path / "in.pt")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # DeepSpeed's venv, not our source tree
    run = subprocess.run(
        [str(DS_PYTHON), str(SCRIPT), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt", weights_only=True)
    ours = _ours(params, grads, hyper)
    assert set(theirs) == set(ours)
    for key, value in ours.items():
        torch.testing.assert_close(value, theirs[key], atol=1e-6, rtol=0, msg=key)
    moved = max((ours[f"param{i}"] - p).abs().max().item() for i, p in enumerate(params))
    assert moved > 1e-3  # the comparison is not between two untouched copies
