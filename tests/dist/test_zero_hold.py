"""ZeRO 0-3 under a pipeline's step: the step-scoped hold ([Note: step-scoped hold] in zero/hold.py) and the
per-micro-batch mode, driven directly on an ordinary engine's ``states`` the way a pipeline stage drives them.

A step runs M micro-batches interleaved as 1F1B interleaves them (the forward of micro-batch i+1 runs while i's
graph is alive, then i's backward), each backward with ``before_backward(communicate=False)`` (hold) or
``communicate=True`` (per micro-batch), then ``reduce_held()`` and the step core. The reference is the same
engine run as plain gradient accumulation (``engine.backward`` / ``engine.step``, GAS = M): after 5 steps the
parameters agree within 1e-5. Traffic per step is read from the comms log and equals ``pipeline_step_traffic``;
model-state bytes at rest and during the held step equal ``pipeline_model_state_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from parity import full_params, global_batches, make_model, optimizer_config, rank_slice

import shardspeed
from shardspeed.zero.memory import pipeline_model_state_bytes, pipeline_step_traffic

STEPS, MB, M, LR, CLIP = 5, 2, 4, 0.05, 0.5
IN_FLIGHT = 2  # forwards alive before the first backward (a 1F1B stage's warm-up)


def _engine(
    stage: int,
    *,
    kind: str = "adamw",
    bf16: bool = False,
    offload: bool = False,
    ckpt: bool = False,
    offload_param: bool = False,
) -> Any:
    model = make_model()
    if ckpt:  # activation checkpointing of one block (non-reentrant: recomputed inside backward)
        inner = model.mid.forward
        model.mid.forward = lambda h: torch.utils.checkpoint.checkpoint(inner, h, use_reentrant=False)  # type: ignore[method-assign]
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload_param:  # shards in host memory between uses (swapped through the pool like NVMe)
        zero["offload_param"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": M,
        "optimizer": optimizer_config(kind, LR),
        "gradient_clipping": CLIP if kind == "adamw" else 0.0,
        "zero_optimization": zero,
        "steps_per_print": 1000,
        "comms_logger": {"enabled": True},
    }
    if bf16:
        config["bf16"] = {"enabled": True}
        config["communication_data_type"] = "fp32"  # the same wire as the plain run's, so only the order differs
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _plain_steps(engine: Any, rank: int, world: int, batches: list) -> None:
    dtype = next(engine.module.parameters()).dtype
    for x, y in batches:
        for m in range(M):
            out = engine(rank_slice(x, m, rank, world, MB).to(dtype)).float()
            engine.backward(F.mse_loss(out, rank_slice(y, m, rank, world, MB)))
            engine.step()


def pipeline_step(
    engine: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    rank: int,
    world: int,
    step: int,
    mode: str = "step",
    modify: Callable[[Any], None] | None = None,
) -> None:
    """One pipeline step on ``engine.states``: M micro-batches, IN_FLIGHT forwards ahead of their backward."""
    states, model = engine.states, engine.module
    dtype = next(model.parameters()).dtype
    losses: dict[int, torch.Tensor] = {}

    def forward(i: int) -> None:
        out = model(rank_slice(x, i, rank, world, MB).to(dtype)).float()
        losses[i] = F.mse_loss(out, rank_slice(y, i, rank, world, MB)) / M

    def backward(i: int) -> None:
        # "last_communicates": the earlier micro-batches hold, the last backward reduces all (as no_sync would)
        communicate = mode == "micro_batch" or (mode == "last_communicates" and i == M - 1)
        states.reducer.before_backward(communicate, final=communicate and i == M - 1)
        losses.pop(i).backward()
        states.reducer.after_backward()

    if mode == "step":
        states.begin_hold()
    for i in range(IN_FLIGHT - 1):
        forward(i)
    for i in range(M):
        if i + IN_FLIGHT - 1 < M:
            forward(i + IN_FLIGHT - 1)
        backward(i)
    if modify is not None:
        modify(states)
    if mode == "step":
        states.reduce_held()
    engine._core.run(want_norm=False, step_index=step)


def _parity(rank: int, world: int, stage: int, variant: str) -> dict[str, float]:
    kind = "sgd" if variant in ("sgd", "doubled") else "adamw"
    options = {v: variant == v for v in ("bf16", "offload", "ckpt", "offload_param")}
    mode = variant if variant in ("micro_batch", "last_communicates") else "step"
    batches = global_batches(STEPS, MB * M * world)
    plain = _engine(stage, kind=kind, **options)
    if variant == "doubled":  # the reference doubles mid.weight's gradient inside autograd (linear: same sum)
        plain.module.mid.weight.register_hook(lambda g: 2 * g)
    _plain_steps(plain, rank, world, batches)
    held = _engine(stage, kind=kind, **options)

    def double(states: Any) -> None:
        states.held_grad("mid.weight").mul_(2)  # as the tied-weight sum writes into the held gradient

    for step, (x, y) in enumerate(batches):
        pipeline_step(held, x, y, rank, world, step, mode, double if variant == "doubled" else None)
    want, got = full_params(plain), full_params(held)
    moved = max(float((got[n] - make_model().state_dict()[n]).abs().max()) for n in got)
    return {"diff": max(float((want[n] - got[n]).abs().max()) for n in want), "moved": moved}


VARIANTS = {
    0: ["adamw", "sgd", "bf16", "doubled", "last_communicates"],
    1: ["adamw", "sgd", "bf16", "offload", "doubled", "last_communicates"],
    2: ["adamw", "sgd", "bf16", "offload", "doubled", "micro_batch", "last_communicates"],
    3: ["adamw", "sgd", "bf16", "offload", "doubled", "micro_batch", "ckpt", "offload_param", "last_communicates"],
}
DEFAULT = {(0, "adamw"), (1, "doubled"), (2, "offload"), (2, "micro_batch"), (3, "doubled"), (3, "ckpt")}
DEFAULT |= {(3, "micro_batch"), (3, "last_communicates")}  # the rest (slow) also pass: every stage × variant


@pytest.mark.parametrize(
    ("stage", "variant"),
    [
        pytest.param(s, v, marks=() if (s, v) in DEFAULT else pytest.mark.slow)
        for s, variants in VARIANTS.items()
        for v in variants
    ],
)
def test_pipeline_step_matches_gradient_accumulation(dist_run, stage: int, variant: str) -> None:
    """fp32 (AdamW with clipping, SGD), bf16, CPU optimizer offload, a held gradient modified before the reduction
    (``held_grad`` doubled = the reference's doubled gradient), per-micro-batch mode, activation checkpointing:
    5 interleaved pipeline steps equal 5 plain accumulation steps."""
    tolerance = 1e-5
    for r in dist_run(_parity, 2, stage, variant):
        assert r["moved"] > 1e-3  # training really changed the parameters
        assert r["diff"] <= tolerance, r


WIDTH = 8  # every parameter has an even size: no padding at N = 2, so the byte figures are exact


def _even_engine(stage: int, bf16: bool = False) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 4)
    )
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": M,
        "optimizer": optimizer_config("sgd", LR),  # momentum: K = 4 bytes per element
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 40,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,  # gathered only when used: the working set below is the protocol's
        },
        "steps_per_print": 1000,
        "comms_logger": {"enabled": True},
        "bf16": {"enabled": bf16},
    }
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _traffic(engine: Any) -> float:
    """Algorithmic elements of gradient reductions and parameter gathers so far (not the step's scalar checks)."""
    totals = engine.comms_log.totals
    return sum(t.algorithmic_elements for key, t in totals.items() if key.split(":")[-1] in ("grads", "params"))


def _states_bytes(engine: Any) -> int:
    breakdown = dict(engine.memory_breakdown())
    breakdown.pop("peak_bucket_bytes")
    return sum(breakdown.values())


def _figures(rank: int, world: int, stage: int, precision: str) -> dict[str, Any]:
    engine = _even_engine(stage, bf16=precision == "mixed")
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(MB * M * world, WIDTH, generator=g), torch.randn(MB * M * world, 4, generator=g))]
    x, y = batches[0]
    pipeline_step(engine, x, y, rank, world, 0)  # the first step plans the layout and creates optimizer states
    during: dict[str, int] = {}
    before = _traffic(engine)
    pipeline_step(engine, x, y, rank, world, 1, modify=lambda s: during.update(bytes=_states_bytes(engine)))
    held_traffic = _traffic(engine) - before
    at_rest = _states_bytes(engine)
    before = _traffic(engine)
    states = engine.states
    if stage == 3:
        states.reducer.reset_peaks()
    pipeline_step(engine, x, y, rank, world, 2, mode="micro_batch")
    return {
        "psi": states.padded_numel,
        "numel": 2 * (WIDTH * WIDTH + WIDTH) + 4 * WIDTH + 4,  # the model's parameters (placeholders at stage 3)
        "held_traffic": held_traffic,
        "micro_traffic": _traffic(engine) - before,
        "during": during["bytes"],
        "at_rest": at_rest,
        "after_micro": _states_bytes(engine),
        "peak_backward": states.reducer.peak_live_backward if stage == 3 else 0,
    }


@pytest.mark.parametrize("precision", ["fp32", pytest.param("mixed", marks=pytest.mark.slow)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_pipeline_traffic_and_memory_match_formulas(dist_run, stage: int, precision: str) -> None:
    """Per step, from the comms log: held — one reduction (2Ψ(N−1)/N in all at every stage: stage 3 gathers each
    unit once); per micro-batch — M gradient reductions (stage 3: a gather per use). Model-state bytes from
    ``memory_breakdown()``: at rest the ZeRO table on Ψ_stage, during the held step plus the held gradients
    (stage 2, 3) and the gathered stage (3)."""
    k = 4 if precision == "fp32" else 8  # SGD momentum (+ the fp32 master under bf16 training)
    for r in dist_run(_figures, 2, stage, precision):
        psi = r["psi"]
        assert psi == r["numel"]  # no padding: the figures below are exact
        assert r["held_traffic"] == pipeline_step_traffic(psi, 2, stage, hold=True, micro_batches=M)
        assert r["held_traffic"] == psi  # 2Ψ(N−1)/N at N = 2, whatever the stage
        assert r["micro_traffic"] == pipeline_step_traffic(psi, 2, stage, hold=False, micro_batches=M)
        want = pipeline_model_state_bytes(psi, 2, stage, precision=precision, optimizer_state_bytes_per_param=k)
        assert r["at_rest"] == want.at_rest.total() == r["after_micro"]
        assert r["during"] == want.during_step()
        if stage == 3 and precision == "fp32":
            # per micro-batch under 1F1B, a unit is released as soon as its use in a backward ends, also in the
            # backward of a micro-batch whose forward ran during an earlier micro-batch's graph: never all at once
            assert r["peak_backward"] == WIDTH * WIDTH + WIDTH, r["peak_backward"]  # the largest unit alone
            assert want.at_rest.total() == 12 * psi // 2  # 12Ψ/N with SGD momentum (16Ψ/N with Adam)
            assert want.during_step() == 12 * psi // 2 + 8 * psi  # + the gathered stage + its fp32 held gradients


def _abort_then_step(rank: int, world: int) -> dict[int, dict[str, Any]]:
    """Per stage: half a held step, ``abort_hold()``, then a whole pipeline step equals a fresh engine's."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(MB * M * world, WIDTH, generator=g), torch.randn(MB * M * world, 4, generator=g)
    out: dict[int, dict[str, Any]] = {}
    for stage in range(4):
        engine, fresh = _even_engine(stage), _even_engine(stage)
        states, r = engine.states, {}
        states.begin_hold()
        for i in range(2):
            states.reducer.before_backward(False)
            F.mse_loss(engine.module(rank_slice(x, i, rank, world, MB)), rank_slice(y, i, rank, world, MB)).backward()
            states.reducer.after_backward()
            if stage == 3:  # held: every unit gathered by its first use is still gathered after each backward
                r.setdefault("gathered", []).append(len(states.unsharded_units()))
        r["held_norm"] = float(states.held_grad("2.weight").norm())
        try:
            states.held_grad("2.wieght")
        except KeyError as err:
            r["error"] = str(err)
        states.abort_hold()
        r["after_abort"] = len(states.unsharded_units()) if stage == 3 else 0
        r["comms_after_abort"] = _traffic(engine)
        pipeline_step(engine, x, y, rank, world, 0)
        pipeline_step(fresh, x, y, rank, world, 0)
        want, got = full_params(fresh), full_params(engine)
        r["diff"] = max(float((want[n] - got[n]).abs().max()) for n in want)
        out[stage] = r
    return out


def test_abort_hold_forgets_the_step_and_names_unknown_parameters(dist_run) -> None:
    for by_stage in dist_run(_abort_then_step, 2):
        for stage, r in by_stage.items():
            assert r["held_norm"] > 0  # held_grad reads what the backward passes accumulated
            assert "'2.wieght' is not a trainable parameter" in r["error"]
            assert r["diff"] == 0.0, (stage, r)  # nothing of the aborted half-step reached the next step
            # held backward passes reduce nothing; stage 3 gathered each unit once for both micro-batches: Ψ(N−1)/N
            assert r["comms_after_abort"] == (0 if stage < 3 else (2 * (WIDTH * WIDTH + WIDTH) + 4 * WIDTH + 4) / 2)
        assert by_stage[3]["gathered"] == [3, 3] and by_stage[3]["after_abort"] == 0
