"""Runs DeepSpeed 0.19.6's ZeroOneAdam / OnebitLamb on one process (world 1) for the parity tests.

Executed by /work/ds0196venv's python in a subprocess: ``python ds_onebit_runner.py IN OUT``. IN holds a list of cases
``{"name", "kwargs", "params": [tensors], "grads": [[tensors] per step]}`` (one process for all: importing
DeepSpeed takes most of the time); OUT receives, per case, the parameters after every step (and OnebitLamb's
coefficients). DeepSpeed's first ``step()`` only allocates its buffers, so it is
fed a gradient that must not matter (NaN-free garbage) before the real steps. Its communication backend is a
stub of size 1: DeepSpeed skips every collective at that size.
"""

import os
import sys
import types

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed.comm as ds_comm
import torch


class _StubBackend:
    size = 1

    def __init__(self, mpu=None) -> None:
        pass


def main() -> None:
    ds_comm.is_initialized = lambda: True
    ds_comm.get_rank = lambda *a, **k: 0
    # DeepSpeed's real module imports cupy; the optimizers only need the backend's size at world 1.
    stub = types.ModuleType("deepspeed.runtime.comm.nccl")
    stub.NcclBackend = _StubBackend
    sys.modules["deepspeed.runtime.comm.nccl"] = stub
    torch.save([run_case(spec) for spec in torch.load(sys.argv[1])], sys.argv[2])


def run_case(spec: dict) -> dict:
    if spec["name"] == "ZeroOneAdam":
        from deepspeed.runtime.fp16.onebit.zoadam import ZeroOneAdam as cls
    else:
        from deepspeed.runtime.fp16.onebit.lamb import OnebitLamb as cls
    params = [torch.nn.Parameter(t.clone()) for t in spec["params"]]
    engine = types.SimpleNamespace(mpu=None, local_rank=0)
    opt = cls(params, deepspeed=engine, comm_backend_name="nccl", **spec["kwargs"])
    for p in params:
        p.grad = torch.full_like(p, 123.0)
    opt.step()  # DeepSpeed's buffer-allocating first step: must not move the parameters
    assert all(torch.equal(p, t) for p, t in zip(params, spec["params"])), "first step moved parameters"
    history, coeffs = [], []
    for grads in spec["grads"]:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        history.append([p.detach().clone() for p in params])
        coeffs.append(list(opt.get_lamb_coeffs()) if hasattr(opt, "get_lamb_coeffs") else [])
    return {"history": history, "coeffs": coeffs}


if __name__ == "__main__":
    main()
