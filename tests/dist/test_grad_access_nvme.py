"""``safe_*_grad`` with ZeRO-3 gradients on NVMe (stage3/grad_offload.py): the stepped tensors' ``.grad`` are zeros
stand-ins there, so the accessors must read the swap file and write it back (norm included), exactly as with the
gradients in memory (``offload_gradients: false``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from parity import full_params, global_batches, rank_slice
from test_offload_grads_nvme import MB, _engine

from shardspeed.utils.safe_access import (
    safe_get_full_grad,
    safe_get_local_grad,
    safe_set_full_grad,
    safe_set_local_grad,
)


def _access(rank: int, world: int, tmp: str, bf16: bool) -> dict[str, Any]:
    (x, y), = global_batches(1, MB * world)  # fmt: skip
    out: dict[str, Any] = {}
    for on_nvme in (False, True):
        engine = _engine(os.path.join(tmp, str(on_nvme)), on_nvme, 1, bf16)
        dtype = next(iter(engine.module.parameters())).dtype
        out_x = engine(rank_slice(x, 0, rank, world, MB).to(dtype)).float()
        engine.backward(F.mse_loss(out_x, rank_slice(y, 0, rank, world, MB)))
        p = next(iter(engine.module.parameters()))  # split across both ranks
        run: dict[str, Any] = {"full": safe_get_full_grad(p), "local": safe_get_local_grad(p)}
        safe_set_full_grad(p, 3 * run["full"])  # each rank keeps its part: the norm must see the new values
        run["local_set"] = safe_get_local_grad(p)
        safe_set_local_grad(p, -2 * run["local"])
        run["full_set"] = safe_get_full_grad(p)
        engine.step()
        run["norm"], run["params"] = engine.get_global_grad_norm(), full_params(engine)
        run["sink"] = engine.states.grad_sink is not None
        out[on_nvme] = run
        engine.destroy()
    return out


@pytest.mark.parametrize("bf16", [False, True])
def test_safe_grad_accessors_with_gradients_on_nvme(dist_run, tmp_path: Path, bf16: bool) -> None:
    for r in dist_run(_access, 2, str(tmp_path), bf16):
        memory, nvme = r[False], r[True]
        assert (memory["sink"], nvme["sink"]) == (False, True)
        assert memory["local"].numel() > 0 and memory["full"].abs().sum() > 0
        for key in ("full", "local", "local_set", "full_set"):
            assert torch.equal(nvme[key], memory[key]), key
        assert torch.allclose(nvme["local_set"], 3 * memory["local"])
        assert not torch.allclose(nvme["full_set"], nvme["full"])
        assert nvme["norm"] == memory["norm"]  # the written values' squared sums, bit for bit
        for name, p in memory["params"].items():
            assert torch.equal(nvme["params"][name], p), name
