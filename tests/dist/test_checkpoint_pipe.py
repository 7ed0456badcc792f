"""Checkpoints across pipeline degrees ([Note: checkpoints across pipeline degrees] in checkpoint/pipe_stages.py),
without the pipeline engine: each pipe stage is a plain module holding its layers under their global names (layers
"0".."3", a weight ``tied_modules.embed.weight`` on both stages whose copy on stage 1 the root declares through
``tied_copy_names()``), trained through ``ShardSpeedEngine`` with a local loss per stage. Saved at PP=2 it loads at
PP=1 — parameters and Adam moments equal — and back at PP=2, where training continues with the saving run's
losses; the tied weight is written once (by its owner stage) and loaded into both copies; strict name checks see
the whole model; zero-to-fp32 gives the whole model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from shardspeed.checkpoint import get_fp32_state_dict_from_zero_checkpoint
from shardspeed.config.load import load_config
from shardspeed.engine import ShardSpeedEngine
from shardspeed.topology import MeshShape, Topology
from shardspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

V, D, MICRO = 7, 6, 2
LAYERS = 4
TIED = "tied_modules.embed.weight"


class Block(nn.Module):
    """A linear layer and a persistent buffer (checkpoints carry buffers)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        torch.manual_seed(100 + index)  # the same values whichever stage builds it
        self.lin = nn.Linear(D, D)
        self.register_buffer("shift", torch.full((D,), 0.01 * index))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) + self.shift)


class TiedEmbed(nn.Module):
    """The weight tied across the first and last stage (an embedding / LM head), with a buffer both stages hold."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.weight = nn.Parameter(torch.randn(V, D) * 0.5)
        self.register_buffer("scale", torch.tensor([1.5]))

    def forward(self) -> torch.Tensor:
        # the same term on every stage holding a copy: equal gradients keep the copies equal (the pipeline engine
        # sums the copies' gradients instead; this test has no pipeline engine)
        return (self.weight * self.scale).pow(2).mean()


class Stage(nn.Module):
    """The layers one pipe stage holds, under their global indices, plus the tied module."""

    def __init__(self, layers: list[int], copies: frozenset[str], extra: int | None = None) -> None:
        super().__init__()
        self.tied_modules = nn.ModuleDict({"embed": TiedEmbed()})
        self.held = [*layers, *([extra] if extra is not None else [])]
        for index in self.held:
            self.add_module(str(index), Block(index))
        self._copies = copies

    def tied_copy_names(self) -> frozenset[str]:
        return self._copies

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for index in self.held:
            x = getattr(self, str(index))(x)
        return (x - y).pow(2).mean() + self.tied_modules["embed"]()


def _stage_model(pp: int, stage: int, extra: int | None = None) -> Stage:
    per = LAYERS // pp
    layers = list(range(stage * per, (stage + 1) * per))
    return Stage(layers, frozenset({TIED}) if stage > 0 else frozenset(), extra)


def _engine(world: int, pp: int, zero: int, extra: int | None = None) -> ShardSpeedEngine:
    dp = world // pp
    topology = Topology.build(MeshShape(pipe=pp, data=dp))
    model = _stage_model(pp, topology.pipe.rank, extra)
    config = {
        "train_batch_size": MICRO * dp,
        "train_micro_batch_size_per_gpu": MICRO,
        # per-tensor AdamW: with the default fused kernel the PP=1 round trip continues equal only to rounding
        # (cause not yet isolated, see the issue #16 note); the bitwise check runs on this kernel
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01, "fused": False}},
        "gradient_clipping": 0.5,
        "zero_optimization": {
            "stage": zero,
            "reduce_bucket_size": 16,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 1000,
    }
    return ShardSpeedEngine(model, load_config(config, dp_world_size=dp), topology)


def _train(engine: ShardSpeedEngine, steps: int) -> list[float]:
    """Local losses: each (stage, data rank) draws its own batch from the step number."""
    losses = []
    for _ in range(steps):
        g = torch.Generator().manual_seed(
            1000 * engine.global_steps + 10 * engine.topology.pipe.rank + engine.topology.dp_rank
        )
        x, y = torch.randn(MICRO, D, generator=g), torch.randn(MICRO, D, generator=g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _snapshot(engine: ShardSpeedEngine) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's parameters (fp32), Adam moments and buffers (collective over the data axis)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in engine.module.named_parameters():
        out[name] = {
            "param": safe_get_full_fp32_param(p).clone(),
            "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
            "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone(),
        }
    for name, b in engine.module.named_buffers():
        out[name] = {"buffer": b.detach().clone()}
    return out


def _run(rank: int, world: int, pp: int, zero: int, before: int, save: str | None, load: str | None, after: int):
    engine = _engine(world, pp, zero)
    if load is not None:
        path, _ = engine.load_checkpoint(load)
        assert path is not None
    _train(engine, before)
    if save is not None:
        engine.save_checkpoint(save)
    snapshot = _snapshot(engine)
    return {
        "stage": engine.topology.pipe.rank,
        "dp": engine.topology.dp_rank,
        "snapshot": snapshot,
        "steps": engine.global_steps,
        "losses": _train(engine, after),
    }


def _whole(results: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """The whole model's values from every stage's data rank 0; a tied weight's copies must be equal."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for result in results:
        if result["dp"] != 0:
            continue
        for name, values in result["snapshot"].items():
            if name in out:  # a copy held by another stage: bitwise the owner's
                for key, value in values.items():
                    torch.testing.assert_close(value, out[name][key], rtol=0, atol=0, msg=f"{name} {key}")
            else:
                out[name] = values
    return out


def _assert_same(want: dict, got: dict) -> None:
    assert want.keys() == got.keys()
    for name in want:
        for key in want[name]:
            torch.testing.assert_close(got[name][key], want[name][key], rtol=0, atol=0, msg=f"{name} {key}")


def _losses(results: list[dict]) -> dict[tuple[int, int], list[float]]:
    return {(r["stage"], r["dp"]): r["losses"] for r in results}


def _round_trip(dist_run, tmp_path: Path, dp: int, zero: int, zero_back: int) -> None:
    """PP=2 × DP=dp saves; PP=1 (one process) loads it and saves; PP=2 loads that and continues."""
    first, second = str(tmp_path / "pp2"), str(tmp_path / "pp1")
    saved = dist_run(_run, 2 * dp, 2, zero, 2, first, None, 2)
    whole = _whole(saved)
    assert set(whole) == {TIED, "tied_modules.embed.scale"} | {
        f"{i}.{k}" for i in range(LAYERS) for k in ("lin.weight", "lin.bias", "shift")
    }
    flat = dist_run(_run, 1, 1, (zero + 1) % 4, 0, None, first, 0)
    _assert_same(whole, _whole(flat))
    assert flat[0]["steps"] == 2
    dist_run(_resave, 1, first, second, (zero + 2) % 4)
    back = dist_run(_run, 2 * dp, 2, zero_back, 0, None, second, 2)
    _assert_same(whole, _whole(back))
    assert _losses(back) == _losses(saved)  # training continues exactly where the PP=2 run left off


def _resave(rank: int, world: int, load: str, save: str, zero: int) -> None:
    engine = _engine(world, 1, zero)
    engine.load_checkpoint(load)
    engine.save_checkpoint(save)


def _writers(entry: dict) -> set[int]:
    """Global ranks whose files hold the tensor's indexed chunks (files are named ``rank<R>-<n>.safetensors``)."""
    return {int(chunk["file"].removeprefix("rank").split("-")[0]) for chunk in entry["chunks"]}


def test_pp2_dp2_checkpoint_loads_at_pp1_and_back(dist_run, tmp_path: Path) -> None:
    _round_trip(dist_run, tmp_path, dp=2, zero=1, zero_back=2)
    index = json.loads((tmp_path / "pp2" / "global_step2" / "index.json").read_text())["tensors"]
    meta = json.loads((tmp_path / "pp2" / "global_step2" / "metadata.json").read_text())["metadata"]
    # the tied weight and its module's buffer written once, by the owner stage (global ranks 0-1 at DP=2)
    assert _writers(index[f"param/{TIED}"]) <= {0, 1}
    assert _writers(index[f"optim/{TIED}/exp_avg"]) <= {0, 1}
    assert _writers(index["buffer/tied_modules.embed.scale"]) == {0}
    # stage 1's layers written by stage 1 (global ranks 2-3), both stages' buffers present
    assert _writers(index["param/3.lin.weight"]) <= {2, 3}
    assert _writers(index["buffer/3.shift"]) == {2}
    assert meta["mesh"] == {"pipe": 2, "data": 2, "tensor": 1}
    assert set(meta["params"]) == {TIED} | {f"{i}.lin.{k}" for i in range(LAYERS) for k in ("weight", "bias")}
    # zero-to-fp32 sees the whole model
    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "pp2"))
    assert set(state) == set(meta["params"]) | {"tied_modules.embed.scale"} | {f"{i}.shift" for i in range(LAYERS)}


@pytest.mark.parametrize(("dp", "zero", "zero_back"), [(1, 3, 0)])
def test_pp2_checkpoint_round_trip_zero3(dist_run, tmp_path: Path, dp: int, zero: int, zero_back: int) -> None:
    _round_trip(dist_run, tmp_path, dp=dp, zero=zero, zero_back=zero_back)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [1, 2])
def test_pp2_checkpoint_round_trip_every_stage(dist_run, tmp_path: Path, dp: int, zero: int) -> None:
    _round_trip(dist_run, tmp_path, dp=dp, zero=zero, zero_back=(zero + 3) % 4)


# --- strict name checks see the whole model ----------------------------------------------------------------------
def _load_strict(rank: int, world: int, pp: int, ckpt: str, extra: int | None, strict: bool) -> Any:
    engine = _engine(world, pp, 0, extra=extra if rank == world - 1 else None)
    try:
        engine.load_checkpoint(ckpt, load_module_strict=strict)
    except ValueError as error:
        return str(error)
    return "loaded"


def test_strict_load_names_what_no_rank_holds(dist_run, tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    dist_run(_run, 2, 2, 0, 1, ckpt, None, 0)
    # PP=2 holds every name between its stages: nothing unexpected, though each stage holds half
    assert dist_run(_load_strict, 2, 2, ckpt, None, True) == ["loaded", "loaded"]
    # a layer the checkpoint lacks on the last stage: missing there, the same error on every rank
    messages = dist_run(_load_strict, 2, 2, ckpt, 5, True)
    assert messages[0] == messages[1]
    assert "missing ['5.lin.bias', '5.lin.weight']" in messages[0] and "unexpected []" in messages[0]
    assert dist_run(_load_strict, 2, 2, ckpt, 5, False) == ["loaded", "loaded"]


def _load_partial(rank: int, world: int, ckpt: str) -> str:
    # one process holding only stage 0's layers: stage 1's names are in the checkpoint and held by nobody
    topology = Topology.build(MeshShape())
    config = {"train_batch_size": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 0.02}}}
    engine = ShardSpeedEngine(_stage_model(2, 0), load_config(config, dp_world_size=1), topology)
    try:
        engine.load_checkpoint(ckpt)
    except ValueError as error:
        return str(error)
    return "loaded"


def test_strict_load_of_a_whole_checkpoint_into_part_of_the_model_names_the_rest(dist_run, tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    dist_run(_run, 2, 2, 0, 1, ckpt, None, 0)
    (message,) = dist_run(_load_partial, 1, ckpt)
    assert "missing [], unexpected ['2.lin.bias', '2.lin.weight', '3.lin.bias', '3.lin.weight']" in message


# --- the whole model's weights from a pipelined engine ------------------------------------------------------------
def _whole_weights(rank: int, world: int, zero: int, out: str) -> dict[str, Any]:
    engine = _engine(world, 2, zero)
    _train(engine, 1)
    snapshot = _snapshot(engine)
    state = {name: value.clone() for name, value in engine.module_state_dict().items()}  # buffers: live tensors
    engine_keys = sorted(engine.state_dict())
    assert engine.save_16bit_model(out)
    # the whole model loads back into every stage: each keeps its own layers, nothing is unexpected
    moved = {f"module.{name}": value + 1.0 for name, value in state.items()}
    result = engine.load_state_dict(moved)
    loaded = {name: safe_get_full_fp32_param(p).clone() for name, p in engine.module.named_parameters()}
    try:
        engine.load_state_dict({**moved, "module.9.lin.weight": torch.zeros(D, D)})
        strict_error = "loaded"
    except RuntimeError as error:
        strict_error = str(error)
    return {
        "stage": engine.topology.pipe.rank,
        "dp": engine.topology.dp_rank,
        "snapshot": snapshot,
        "state": state,
        "engine_keys": engine_keys,
        "incompatible": (list(result.missing_keys), list(result.unexpected_keys)),
        "loaded": loaded,
        "strict_error": strict_error,
    }


@pytest.mark.parametrize(("world", "zero"), [(2, 3), (4, 1)])
def test_module_state_dict_and_16bit_save_give_the_whole_model(dist_run, tmp_path: Path, world: int, zero: int):
    results = dist_run(_whole_weights, world, zero, str(tmp_path / "weights"))
    whole = _whole(results)
    names = set(whole)
    written = load_file(str(tmp_path / "weights" / "pytorch_model.safetensors"))
    assert set(written) == names
    for result in results:
        assert set(result["state"]) == names  # every rank holds the whole model
        assert result["engine_keys"] == sorted(f"module.{n}" for n in names)
        assert result["incompatible"] == ([], [])
        assert "unexpected keys ['module.9.lin.weight']" in result["strict_error"]
        for name, values in whole.items():
            value = values.get("param", values.get("buffer"))
            torch.testing.assert_close(result["state"][name], value, rtol=0, atol=0, msg=name)
            torch.testing.assert_close(written[name], value, rtol=0, atol=0, msg=name)
        for name, value in result["loaded"].items():  # this stage's parameters took the loaded values
            torch.testing.assert_close(value, whole[name]["param"] + 1.0, rtol=0, atol=0, msg=name)
    # a one-process model holding every layer loads the file as it is
    flat = _stage_model(1, 0)
    flat.load_state_dict(written, strict=True)


# --- with the real PipelineModule ----------------------------------------------------------------------------------
def _head(embed: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return x @ embed.weight.t()


def _pipe_specs() -> list:
    from shardspeed.pipe import LayerSpec, TiedLayerSpec

    return [
        TiedLayerSpec("embed", nn.Embedding, V, D),
        LayerSpec(Block, 1),
        LayerSpec(Block, 2),
        TiedLayerSpec("embed", nn.Embedding, V, D, forward_fn=_head),
    ]


def _pipe_run(rank: int, world: int, pp: int, zero: int, steps: int, save: str | None, load: str | None) -> dict:
    from shardspeed.pipe import PipelineModule

    module = PipelineModule(_pipe_specs(), num_stages=pp, partition_method="uniform", seed_layers=True)
    config = {
        "train_batch_size": MICRO,
        # per-tensor AdamW: with the default fused kernel the PP=1 round trip continues equal only to rounding
        # (cause not yet isolated, see the issue #16 note); the bitwise check runs on this kernel
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01, "fused": False}},
        "zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    engine = ShardSpeedEngine(module, load_config(config, dp_world_size=1), module.topology)
    if load is not None:
        engine.load_checkpoint(load)
    stage = module.stage_id
    for step in range(steps):  # a local loss per stage (no pipeline engine here): stage 1 gets a random activation
        g = torch.Generator().manual_seed(10 * step + stage)
        x = torch.randint(0, V, (MICRO,), generator=g) if stage == 0 else torch.randn(MICRO, D, generator=g)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    if save is not None:
        engine.save_checkpoint(save)
    return {"stage": stage, "dp": 0, "snapshot": _snapshot(engine), "copies": sorted(engine.param_specs.tied_copies)}


@pytest.mark.parametrize("zero", [0, 2])  # not 3 here: the head's forward_fn reads the embedding's weight without
# calling the module, so outside the pipeline engine's step-scoped hold ZeRO-3 never gathers it (see the report)
def test_pipeline_module_checkpoint_loads_at_pp1(dist_run, tmp_path: Path, zero: int) -> None:
    ckpt = str(tmp_path / "ckpt")
    saved = dist_run(_pipe_run, 2, 2, zero, 2, ckpt, None)
    assert [r["copies"] for r in saved] == [[], ["tied_modules.embed.weight"]]
    owner: dict = {}
    for result in saved:  # the copies were trained apart (nobody summed their gradients): the owner's is saved
        for name, values in result["snapshot"].items():
            owner.setdefault(name, values)
    (flat,) = dist_run(_pipe_run, 1, 1, (zero + 1) % 4, 0, None, ckpt)
    _assert_same(owner, flat["snapshot"])
    index = json.loads((tmp_path / "ckpt" / "global_step2" / "index.json").read_text())["tensors"]
    assert _writers(index["param/tied_modules.embed.weight"]) == {0}


# --- tensor × pipe --------------------------------------------------------------------------------------------------
class TPBlock(nn.Module):
    """A column- then row-parallel pair (global init sliced: the same global weights at any TP)."""

    def __init__(self, index: int, tp: Any) -> None:
        super().__init__()
        from shardspeed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        torch.manual_seed(100 + index)
        self.up = ColumnParallelLinear(D, 2 * D, tp)
        self.down = RowParallelLinear(2 * D, D, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class TPStage(Stage):
    def __init__(self, layers: list[int], copies: frozenset[str], tp: Any) -> None:
        nn.Module.__init__(self)
        self.tied_modules = nn.ModuleDict({"embed": TiedEmbed()})
        self.held = layers
        for index in layers:
            self.add_module(str(index), TPBlock(index, tp))
        self._copies = copies


def _tp_run(rank: int, world: int, pp: int, tp: int, zero: int, steps: int, save: str | None, load: str | None):
    from shardspeed.tensor_parallel import TensorParallel

    dp = world // (pp * tp)
    topology = Topology.build(MeshShape(pipe=pp, data=dp, tensor=tp))
    stage, per = topology.pipe.rank, LAYERS // pp
    copies = frozenset({TIED}) if stage > 0 else frozenset()
    model = TPStage(list(range(stage * per, (stage + 1) * per)), copies, TensorParallel.from_topology(topology))
    config = {
        "train_batch_size": MICRO * dp,
        "train_micro_batch_size_per_gpu": MICRO,
        # per-tensor AdamW: with the default fused kernel the PP=1 round trip continues equal only to rounding
        # (cause not yet isolated, see the issue #16 note); the bitwise check runs on this kernel
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01, "fused": False}},
        "zero_optimization": {"stage": zero, "reduce_bucket_size": 16, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    engine = ShardSpeedEngine(model, load_config(config, dp_world_size=dp), topology)
    if load is not None:
        engine.load_checkpoint(load)
    _train(engine, steps)
    if save is not None:
        engine.save_checkpoint(save)
    return {name: value.clone() for name, value in engine.module_state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
def test_tp2_pp2_checkpoint_loads_at_tp1_pp1_and_back(dist_run, tmp_path: Path, zero: int) -> None:
    first, second = str(tmp_path / "tp2pp2"), str(tmp_path / "flat")
    saved = dist_run(_tp_run, 4, 2, 2, zero, 2, first, None)  # TP=2 × PP=2
    consolidated = get_fp32_state_dict_from_zero_checkpoint(first)  # the global tensors, every stage's
    for state in saved:  # module_state_dict: the whole dense model on every rank
        assert set(state) == set(consolidated)
        for name, value in consolidated.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    (flat,) = dist_run(_tp_run, 1, 1, 1, (zero + 1) % 4, 0, second, first)  # TP=1 × PP=1 loads and saves
    back = dist_run(_tp_run, 4, 2, 2, (zero + 2) % 4, 0, None, second)  # and TP=2 × PP=2 again
    for state in [flat, *back]:
        assert state.keys() == saved[0].keys()
        for name, value in saved[0].items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
