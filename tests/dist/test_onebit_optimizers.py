"""ZeroOneAdam and OneBitLamb over gloo at 2 and 4 ranks, bound to ``Collectives`` directly (no engine).

Parity with the one-process reference of the same algorithm (``onebit_workers.simulate``: N simulated workers,
``compression.reference`` for the compressed means); parameters identical on every rank; the traffic the
comms log counts in the compressed phase against an fp32 ring all-reduce of the same elements; resume from
``state_dict`` + ``compression_state_dict`` at the same world size bit-exact with an uninterrupted run.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
from onebit_workers import feed, simulate

from harness import run_ranks
from shardspeed.comm import Collectives, CommsLog
from shardspeed.compression.onebit_lamb import OneBitLamb
from shardspeed.compression.zero_one_adam import ZeroOneAdam, step_kind
from shardspeed.topology import AxisGroup

SMALL = ((6, 5), (9,), (3, 4))
CASES: dict[str, tuple[type, dict[str, Any], int]] = {
    "ZeroOneAdam": (
        ZeroOneAdam,
        {"lr": 0.01, "weight_decay": 0.01, "var_freeze_step": 8, "var_update_scaler": 2, "local_step_scaler": 3,
         "local_step_clipper": 4},
        20,
    ),
    "OneBitLamb": (OneBitLamb, {"lr": 0.01, "freeze_step": 4, "weight_decay": 0.01}, 10),
}  # fmt: skip


def _params(shapes: tuple[tuple[int, ...], ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(*s, generator=gen) for s in shapes]


def _round_trip(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def _train(
    rank: int, world: int, name: str, shapes: tuple, steps: int, cut: int | None = None
) -> tuple[list[list[torch.Tensor]], list[float], list[str]]:
    """Parameters after every step, the comms log's bytes per step, and each step's kind (0/1 Adam)."""
    cls, kwargs, _ = CASES[name]
    c = Collectives(CommsLog(enabled=True), verify_order=True)
    axis = AxisGroup("data", dist.group.WORLD, tuple(range(world)), rank)
    live = [torch.nn.Parameter(t) for t in _params(shapes)]
    opt = cls(live, **kwargs)
    opt.bind(c, axis)
    grads = feed(11, shapes, world)
    history, nbytes, kinds = [], [], []
    for step in range(steps):
        if step == cut:  # a checkpoint: a fresh optimizer (and its compressors) from the saved state
            saved = _round_trip({"optimizer": opt.state_dict(), "errors": opt.compression_state_dict()})
            opt = cls(live, **kwargs)
            opt.bind(c, axis)
            opt.load_state_dict(saved["optimizer"])
            opt.load_compression_state_dict(saved["errors"], same_world=True)
        if name != "ZeroOneAdam":
            kinds.append("")
        else:  # the first step only creates states (DeepSpeed's initialization step)
            kinds.append("init" if opt.schedule().step == 0 else step_kind(opt.schedule(), opt.var_freeze_step))
        for p, g in zip(live, grads(step, rank, opt), strict=True):
            p.grad = g
        before = c.log.algorithmic_bytes()
        opt.step()
        nbytes.append(c.log.algorithmic_bytes() - before)
        history.append([p.detach().clone() for p in live])
    return history, nbytes, kinds


@pytest.mark.parametrize("name,world", [("ZeroOneAdam", 2), ("OneBitLamb", 2), ("OneBitLamb", 4)])
def test_equals_simulated_workers_and_agrees_on_every_rank(tmp_path: Any, name: str, world: int) -> None:
    cls, kwargs, steps = CASES[name]
    out = run_ranks(_train, world, tmp_path, name, SMALL, steps)
    expected = simulate(lambda ps: cls(ps, **kwargs), _params(SMALL), feed(11, SMALL, world), world, steps)
    for rank, (history, _, _) in enumerate(out):
        for step, (got, want) in enumerate(zip(history, expected, strict=True)):
            for g, w in zip(got, want[rank], strict=True):
                torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6, msg=lambda m, s=step: f"step {s + 1}: {m}")
            if rank and out[0][2][step] != "local":  # 0/1 Adam's local steps diverge until the next sync
                assert all(torch.equal(g, h) for g, h in zip(got, out[0][0][step], strict=True)), step
    # Compression moved the parameters away from the full-precision run (the test could fail).
    exact = simulate(lambda ps: cls(ps, **kwargs), _params(SMALL), feed(11, SMALL, world), 1, steps)
    assert not torch.equal(out[0][0][-1][0], exact[-1][0][0])
    if name == "ZeroOneAdam":
        assert {"variance", "compressed", "local", "sync"} <= set(out[0][2])
        local = out[0][2].index("local")
        assert not torch.equal(out[0][0][local][0], out[1][0][local][0])  # they did diverge


@pytest.mark.parametrize("name", ["ZeroOneAdam", "OneBitLamb"])
def test_resume_at_the_same_world_size_is_bit_exact(tmp_path: Any, name: str) -> None:
    steps = CASES[name][2]
    cut = 12 if name == "ZeroOneAdam" else 6  # inside the compressed phase: error buffers and counters pending
    straight = run_ranks(_train, 2, tmp_path, name, SMALL, steps)
    resumed = run_ranks(_train, 2, tmp_path, name, SMALL, steps, cut)
    for a, b in zip(straight, resumed, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a[0][-1], b[0][-1], strict=True))


def _traffic(rank: int, world: int) -> dict[str, float]:
    shapes = ((256, 256), (256,))
    numel = sum(torch.Size(s).numel() for s in shapes)
    fp32_ring = 2 * (world - 1) / world * 4 * numel
    _, zo_bytes, kinds = _train(rank, world, "ZeroOneAdam", shapes, 20)
    compressed = [b for b, k in zip(zo_bytes, kinds, strict=True) if k in ("local", "sync")]
    syncs = [b for b, k in zip(zo_bytes, kinds, strict=True) if k == "sync"]
    _, lamb_bytes, _ = _train(rank, world, "OneBitLamb", shapes, 8)
    return {
        "zero_one_compressed_phase": sum(compressed) / len(compressed) / fp32_ring,
        "zero_one_sync": sum(syncs) / len(syncs) / fp32_ring,
        "zero_one_variance_step": zo_bytes[1] / fp32_ring,
        "lamb_compressed": lamb_bytes[-1] / fp32_ring,
        "lamb_warmup": lamb_bytes[1] / fp32_ring,
    }


def test_compressed_phase_traffic_against_fp32_ring(tmp_path: Any) -> None:
    ratios = {world: run_ranks(_traffic, world, tmp_path)[0] for world in (2, 4)}
    for world, r in ratios.items():
        print(f"world {world}: " + ", ".join(f"{k} {v * 32:.4f}/32" for k, v in r.items()))
        assert r["zero_one_variance_step"] == pytest.approx(1.0)  # an exact fp32 all-reduce, through the log
        assert r["lamb_warmup"] == 0.0  # the engine all-reduces in the warm-up, not the optimizer
        assert r["zero_one_sync"] <= 1.1 / 32 and r["lamb_compressed"] <= 1.1 / 32
        assert r["zero_one_compressed_phase"] < r["zero_one_sync"]  # local steps send nothing
    for key in ("zero_one_sync", "lamb_compressed"):
        assert abs(ratios[4][key] / ratios[2][key] - 1) <= 0.05
