"""ZeRO-1/2 parameter all-gather overlapped with the next forward (``zero_optimization.overlap_param_gather``).

[Note: overlapped parameter gather] in zero/param_gather.py: ``step()`` launches one all-gather per bucket and
returns; the next forward waits for each bucket in the pre-hook of the first module that owns a parameter in it;
every engine API that reads or writes parameters waits first. The figures asserted are deterministic: how many
gathers are pending, which buckets a module's pre-hook found landed, how many blocking waits under the ``params``
tag were recorded (``Collectives.blocked``) and where. Never a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from parity import IN, OUT, global_batches, make_model, optimizer_config, rank_slice, reference_run, train_engine

import shardspeed

STEPS, MB, LR, CLIP = 5, 2, 0.05, 0.5
BUCKET = 100  # TinyNet's 8 parameters in several buckets


def _config(stage: int, *, overlap: bool = True, gas: int = 1, kind: str = "adamw", **extra: Any) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET}
    zero |= {"overlap_param_gather": overlap, **extra.pop("zero", {})}
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": gas,
        "optimizer": optimizer_config(kind, LR),
        "gradient_clipping": CLIP if kind == "adamw" else 0.0,
        "zero_optimization": zero,
        "steps_per_print": 1000,
        **extra,
    }


def param_waits(engine: Any) -> int:
    """Blocking waits recorded under the ``params`` tag, whatever collective carried the gathers."""
    return sum(n for key, n in engine.collectives.blocked.waits.items() if key.endswith(":params"))


def _run(rank: int, world: int, config: dict, model: torch.nn.Module, gas: int, steps: int = STEPS) -> dict:
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = train_engine(engine, rank, world, global_batches(steps, MB * gas * world), MB, gas)
    pending = engine.states.pending_gathers
    full = engine.module_state_dict()
    return {
        "params": {n: full[n].float().clone() for n, _ in engine.module.named_parameters()},
        "losses": losses,
        "pending_at_end": pending,
        "buckets": len(engine.states.layout.buckets),
    }


def _parity(rank: int, world: int, stage: int, precision: str, kind: str, gas: int, model_kwargs: dict) -> dict:
    extra: dict[str, Any] = {}
    if precision == "bf16":
        extra["bf16"] = {"enabled": True}
    elif precision == "offload_cpu":  # StreamedAdam copies updated chunks into the stepped tensors
        extra["zero"] = {"offload_optimizer": {"device": "cpu"}}
    elif precision == "bf16_masters":
        extra["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    out = {}
    for overlap in (True, False):
        config = _config(stage, overlap=overlap, gas=gas, kind=kind, **dict(extra))
        out[overlap] = _run(rank, world, config, make_model(**model_kwargs), gas)
    return out


def _check_parity(results: list[dict], world: int, precision: str, kind: str, gas: int, model_kwargs: dict) -> None:
    for r in results:
        on, off = r[True], r[False]
        assert on["pending_at_end"] == on["buckets"] > 1, "the last step left every bucket's gather pending"
        assert off["pending_at_end"] == 0
        assert on["losses"] == off["losses"]
        for name, p in on["params"].items():
            assert torch.equal(p, off["params"][name]), name  # the overlap never changes numerics
    if precision in ("fp32", "offload_cpu"):
        ref, _ = reference_run(
            kind, LR, CLIP if kind == "adamw" else 0.0, global_batches(STEPS, MB * gas * world), model_kwargs
        )
        for name, p in results[0][True]["params"].items():
            assert (p - ref[name]).abs().max().item() <= 1e-5, name


DEFAULT_CASES = [  # (world, stage, precision, optimizer, gas): the rest of the matrix is slow
    (2, 1, "fp32", "adamw", 2),
    (2, 2, "bf16_masters", "sgd", 2),
]
MATRIX = [
    (w, s, p, k, g)
    for w in (2, 4)
    for s in (1, 2)
    for p in ("fp32", "bf16", "bf16_masters")
    for k in ("adamw", "sgd")
    for g in (1, 2)
    if (w, s, p, k, g) not in DEFAULT_CASES
] + [(2, s, "offload_cpu", "adamw", g) for s in (1, 2) for g in (1, 2)]


@pytest.mark.parametrize(("world", "stage", "precision", "kind", "gas"), DEFAULT_CASES)
def test_overlap_parity(dist_run, world: int, stage: int, precision: str, kind: str, gas: int) -> None:
    """Overlap on equals overlap off bit for bit, and the fp32 reference to 1e-5 (AdamW with clipping, SGD)."""
    results = dist_run(_parity, world, stage, precision, kind, gas, {})
    _check_parity(results, world, precision, kind, gas, {})


@pytest.mark.slow
@pytest.mark.parametrize(("world", "stage", "precision", "kind", "gas"), MATRIX)
def test_overlap_parity_matrix(dist_run, world: int, stage: int, precision: str, kind: str, gas: int) -> None:
    results = dist_run(_parity, world, stage, precision, kind, gas, {})
    _check_parity(results, world, precision, kind, gas, {})


# --- structure: what step() leaves pending and how the forward lands it ------------------------------------------
def _bucket_of(layout: Any, lo: int) -> int:
    return next(k for k, b in enumerate(layout.buckets) if b.start <= lo < b.end)


def _structure(rank: int, world: int, stage: int, overlap: bool) -> dict:
    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, overlap=overlap)
    )
    states, layout = engine.states, None
    seen: list[tuple[str, list[int]]] = []
    order = ["inp", "mid", "mid2", "out"]  # TinyNet's forward order
    for name in order:  # registered after the engine's hooks: they run once the engine's pre-hook has waited
        getattr(engine.module, name).register_forward_pre_hook(
            lambda m, args, name=name: seen.append((name, states.param_gather.pending_buckets()))
        )
    batches = global_batches(3, MB * world)
    x, y = batches[0]
    engine.backward(F.mse_loss(engine(rank_slice(x, 0, rank, world, MB)), rank_slice(y, 0, rank, world, MB)))
    waits_before_step = param_waits(engine)
    engine.step()
    layout = states.layout
    out: dict[str, Any] = {
        "buckets": len(layout.buckets),
        "pending_after_step": states.pending_gathers,
        "waits_in_step": param_waits(engine) - waits_before_step,
    }
    needs = {}
    index = {id(p): i for i, p in enumerate(states.packed.params)}
    for name in order:
        mod = getattr(engine.module, name)
        needs[name] = sorted({_bucket_of(layout, layout.span(index[id(p)])[0]) for p in mod.parameters()})
    seen.clear()
    before = param_waits(engine)
    x, y = batches[1]
    loss = F.mse_loss(engine(rank_slice(x, 0, rank, world, MB)), rank_slice(y, 0, rank, world, MB))
    out |= {
        "needs": needs,
        "seen": list(seen),
        "waited": list(states.param_gather.waited),
        "waits_in_forward": param_waits(engine) - before,
        "pending_after_forward": states.pending_gathers,
    }
    engine.backward(loss)
    engine.step()
    return out


def _structure_both(rank: int, world: int, stage: int) -> tuple[dict, dict]:
    return _structure(rank, world, stage, True), _structure(rank, world, stage, False)


@pytest.mark.parametrize("stage", [1, 2])
def test_step_launches_and_forward_waits_bucket_by_bucket(dist_run, stage: int) -> None:
    """With overlap on: step() launches and returns, the forward lands bucket by bucket. With it off (same
    processes, to save a start-up): every gather is waited inside step() (``_check_overlap_off``)."""
    results = dist_run(_structure_both, 2, stage)
    _check_overlap_off([off for _, off in results])
    for r, _ in results:
        n = r["buckets"]
        assert n >= 3
        assert r["pending_after_step"] == n  # step() launched every bucket's gather and returned
        assert r["waits_in_step"] == 0  # and blocked on none of them
        assert r["waits_in_forward"] == n and r["pending_after_forward"] == 0  # each waited exactly once
        landed: set[int] = set()
        expected_order: list[int] = []
        for name, pending in r["seen"]:
            assert not set(r["needs"][name]) & set(pending), (name, pending)  # landed before the module ran
            expected_order += [k for k in r["needs"][name] if k not in landed]
            landed |= set(r["needs"][name])
            assert set(pending) == set(range(n)) - landed  # ... and nothing more: later buckets still in flight
        assert r["waited"] == expected_order  # first-use order, one bucket at a time


def _check_overlap_off(results: list[dict]) -> None:
    """``overlap_param_gather: false``: the parameter waits are recorded inside step(), none in the forward."""
    for r in results:
        assert r["pending_after_step"] == 0
        assert r["waits_in_step"] == r["buckets"]
        assert r["waits_in_forward"] == 0


# --- every API that reads or writes parameters waits first ----------------------------------------------------
def _api_values(rank: int, world: int, tmp: str, overlap: bool) -> dict:
    """Each API called right after a step (gathers pending with overlap on): what it returned and whether anything
    was still pending afterwards."""
    from shardspeed.utils import safe_get_full_fp32_param

    torch.manual_seed(0)
    model = make_model()
    config = _config(1, overlap=overlap)
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    states = engine.states
    batches = iter(global_batches(20, MB * world))

    def train_step() -> None:
        x, y = next(batches)
        engine.backward(F.mse_loss(engine(rank_slice(x, 0, rank, world, MB)), rank_slice(y, 0, rank, world, MB)))
        engine.step()

    def snap(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().clone() for k, v in tensors.items()}

    out: dict[str, Any] = {}

    def record(name: str, value: Any) -> None:
        out[name] = (value, states.pending_gathers)

    train_step()
    record("module_state_dict", snap(engine.module_state_dict()))
    train_step()
    record("state_dict", snap(engine.state_dict()))
    train_step()
    record("named_parameters", snap(dict(engine.named_parameters())))
    train_step()
    record("parameters", [p.detach().clone() for p in engine.parameters()])
    train_step()
    with shardspeed.zero.GatheredParameters(list(engine.module.parameters())):
        record("gathered", snap(dict(engine.module.named_parameters())))
    train_step()
    record("safe_get", safe_get_full_fp32_param(engine.module.mid.weight).clone())
    train_step()
    engine.eval()
    with torch.no_grad():
        x = torch.linspace(-1, 1, MB * IN).view(MB, IN)
        record("eval_forward", engine(x).clone())
    engine.train()
    train_step()
    engine.save_checkpoint(tmp, tag="ckpt")
    record("save_checkpoint", states.pending_gathers)
    saved = snap(engine.module_state_dict())
    train_step()
    engine.save_16bit_model(tmp, "model.safetensors")
    record("save_16bit_model", states.pending_gathers)
    train_step()
    engine.load_checkpoint(tmp, tag="ckpt")  # a gather landing after the load would overwrite the loaded values
    record("load_checkpoint", snap(dict(engine.module.named_parameters())))
    out["saved"] = saved
    train_step()
    engine.destroy()
    record("destroy", sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in engine.module.modules()))
    return out


def _api_both(rank: int, world: int, tmp: str) -> tuple[dict, dict]:
    return _api_values(rank, world, tmp + "/on", True), _api_values(rank, world, tmp + "/off", False)


def test_every_api_waits_for_pending_gathers(dist_run, tmp_path: Path) -> None:
    for r_on, r_off in dist_run(_api_both, 2, str(tmp_path)):
        for api, entry in r_on.items():
            if api == "saved":
                continue
            value, pending = entry
            assert pending == 0, f"{api} left a gather pending"
            expected = r_off[api][0]
            if isinstance(value, dict):
                assert value.keys() == expected.keys(), api
                for k in value:
                    assert torch.equal(value[k], expected[k]), (api, k)
            elif isinstance(value, list):
                assert all(torch.equal(a, b) for a, b in zip(value, expected, strict=True)), api
            elif isinstance(value, torch.Tensor):
                assert torch.equal(value, expected), api
            else:
                assert value == expected, api
        loaded = r_on["load_checkpoint"][0]
        for k, v in loaded.items():
            assert torch.equal(v, r_on["saved"][k]), k  # the load's values, not the pending step's
        assert r_on["destroy"][0] == 0  # destroy() removed the gather hooks


def _second_step(rank: int, world: int) -> dict:
    """step() twice without a forward in between: the second waits for the first's gathers before stepping."""
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(2, kind="sgd"))
    x, y = global_batches(1, MB * world)[0]
    engine.backward(F.mse_loss(engine(rank_slice(x, 0, rank, world, MB)), rank_slice(y, 0, rank, world, MB)))
    engine.step()
    first = engine.states.pending_gathers
    waits = param_waits(engine)
    engine.set_gradient_accumulation_boundary(True)
    # the same gradients again (none reduced yet: refused by the step checks, after the wait) ...
    with pytest.raises(RuntimeError, match="never all-reduced"):
        engine.step()
    return {"first": first, "waited_in_second": param_waits(engine) - waits, "pending": engine.states.pending_gathers}


def test_second_step_without_forward_waits(dist_run) -> None:
    for r in dist_run(_second_step, 2):
        assert r["first"] > 1
        assert r["waited_in_second"] == r["first"] and r["pending"] == 0  # waited first thing, even though refused


# --- models: tied weights, activation checkpointing -----------------------------------------------------------
class TiedLM(torch.nn.Module):
    """Token embedding tied to the LM head (one parameter registered in two modules) and a GPT-style second read
    of the embedding in the root's forward, after the embedding module ran."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.block = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = (x.abs() * 3).long().clamp(max=self.embed.num_embeddings - 1)[:, :2]
        h = torch.tanh(self.block(self.embed(tokens).mean(1)))
        return (self.head(h) + h @ self.embed.weight.T)[:, :OUT]


class Checkpointed(torch.nn.Module):
    """TinyNet's layers with the middle ones under non-reentrant activation checkpointing (recompute in backward
    re-runs their forward pre-hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.net
        h = torch.tanh(n.inp(x))
        h = torch.utils.checkpoint.checkpoint(
            lambda t: torch.tanh(n.mid2(torch.tanh(n.mid(t)))), h, use_reentrant=False
        )
        return n.out(h)


def _model_case(rank: int, world: int, which: str, stage: int) -> dict:
    out = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        model = TiedLM() if which == "tied" else Checkpointed()
        out[overlap] = _run(rank, world, _config(stage, overlap=overlap, gas=2), model, 2)
    torch.manual_seed(0)
    ref = TiedLM() if which == "tied" else Checkpointed()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    for x, y in global_batches(STEPS, MB * 2 * world):
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
    out["ref"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return out


def _model_cases(rank: int, world: int, cases: list[tuple[str, int]]) -> list[dict]:
    return [_model_case(rank, world, which, stage) for which, stage in cases]


@pytest.mark.parametrize(
    "cases",
    [
        [("tied", 1), ("checkpointed", 2)],  # one start-up for both
        pytest.param([("tied", 2), ("checkpointed", 1)], marks=pytest.mark.slow),
    ],
)
def test_tied_and_checkpointed_models(dist_run, cases: list[tuple[str, int]]) -> None:
    """A tied embedding / LM head (one parameter owned by two modules, read again in the root's forward) and
    non-reentrant activation checkpointing (recompute re-runs the pre-hooks): equal to overlap off bit for bit and
    to the single-process reference to 1e-5."""
    for per_rank in dist_run(_model_cases, 2, cases):
        for r in per_rank:
            on, off = r[True], r[False]
            assert on["pending_at_end"] == on["buckets"]
            for name, p in on["params"].items():
                assert torch.equal(p, off["params"][name]), name
                assert (p - r["ref"][name]).abs().max().item() <= 1e-5, name


# --- pipeline engine at stage 1 ---------------------------------------------------------------------------------
def _pipe(rank: int, world: int) -> dict:
    from test_pipe_parity import Case, _engine, _train

    case = Case(world=4, zero=1)
    result = _train(rank, world, case)  # overlap on (the default): parity with the single-process reference
    engine = _engine(case)
    from pipe_models import make_batches, rank_iterator

    batches = make_batches(2, 4, 2, engine.topology.data.size, vocab=32, seq=6)
    it = rank_iterator(batches, 4, engine.topology.data.rank, engine.topology.data.size)
    engine.train_batch(it)
    result["pending"] = engine.states.pending_gathers
    result["buckets"] = len(engine.states.layout.buckets)
    engine.train_batch(it)  # its forwards land the gathers
    return result


@pytest.mark.slow  # world 4, two engines: ~12 s
def test_pipeline_stage1(dist_run) -> None:
    from test_pipe_parity import Case, _check

    results = dist_run(_pipe, 4)
    _check(results, Case(world=4, zero=1))
    for r in results:
        assert r["pending"] == r["buckets"] >= 1


# --- a peer failure while a gather is pending -----------------------------------------------------------------
class FailingSGD(torch.optim.SGD):
    """Raises in its second step on rank 1: that rank never launches the second step's gathers."""

    def __init__(self, params: Any, rank: int) -> None:
        super().__init__(params, lr=LR)
        self.calls, self.fail = 0, rank == 1

    def step(self, closure: Any = None) -> Any:
        self.calls += 1
        if self.fail and self.calls == 2:
            raise RuntimeError("optimizer exploded")
        return super().step(closure)


def _peer_failure(rank: int, world: int) -> tuple[str, str]:
    model = make_model()
    config = _config(1, kind="sgd", fault_tolerance={"watch_interval_s": 0.1}, zero_allow_untested_optimizer=True)
    config.pop("optimizer")
    engine, *_ = shardspeed.initialize(model=model, optimizer=FailingSGD(model.parameters(), rank), config=config)
    where = "start"
    try:
        for x, y in global_batches(4, MB * world):
            where = "forward"
            out = engine(rank_slice(x, 0, rank, world, MB))
            where = "backward"
            engine.backward(F.mse_loss(out, rank_slice(y, 0, rank, world, MB)))
            where = "step"
            engine.step()
    except Exception as error:
        return where, f"{type(error).__name__}: {error}"
    return where, "no error"


def test_peer_failure_surfaces_at_the_pending_wait(dist_run) -> None:
    results = dist_run(_peer_failure, 2, deadline_s=60.0)
    assert results[1] == ("step", "RuntimeError: optimizer exploded") or results[1][1].startswith(
        "RuntimeError: optimizer exploded"
    ), results[1]
    where, error = results[0]
    assert where == "forward", results[0]  # rank 0's step returned: it waits for the gather in the next forward
    assert error.startswith("PeerFailedError: rank 1 failed in engine.step()"), error
