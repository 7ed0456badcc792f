"""Runs DeepSpeed 0.19.6's own ``OnebitAdam`` over given parameters and gradients (run by the python of the venv
that has it; test_onebit_adam_parity.py calls it in a subprocess). DeepSpeed's constructor builds a communication
backend (NCCL: cupy) that its warm-up never uses, so a stub backend of world size 1 stands in for it; the process
group is a gloo world of one. Usage: ds_onebit_adam_ref.py IN.pt OUT.pt (tensors only, weights_only loads)."""

import os
import sys
import types

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
    os.environ.setdefault(key, value)
os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))

import torch  # noqa: E402


class _StubBackend:  # what OnebitAdam reads of its backend before freeze_step: the world size
    def __init__(self, mpu=None) -> None:
        self.size = 1


stub = types.ModuleType("deepspeed.runtime.comm.nccl")
stub.NcclBackend = _StubBackend
sys.modules["deepspeed.runtime.comm.nccl"] = stub

import deepspeed  # noqa: E402
from deepspeed.runtime.fp16.onebit.adam import OnebitAdam  # noqa: E402


def main(inp: str, out: str) -> None:
    data = torch.load(inp, weights_only=True)
    deepspeed.init_distributed(dist_backend="gloo")
    params = [torch.nn.Parameter(p.clone()) for p in data["params"]]
    h = data["hyper"].tolist()  # lr, beta1, beta2, eps, weight_decay, freeze_step
    opt = OnebitAdam(
        params,
        deepspeed=types.SimpleNamespace(mpu=None),
        lr=h[0],
        betas=(h[1], h[2]),
        eps=h[3],
        weight_decay=h[4],
        freeze_step=int(h[5]),
    )
    steps = data["grads"]  # [steps][params]
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    result = {f"param{i}": p.detach().clone() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        result[f"exp_avg{i}"] = opt.state[p]["exp_avg"].clone()
        result[f"exp_avg_sq{i}"] = opt.state[p]["exp_avg_sq"].clone()
    torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
