"""zero.Init: a model built on the meta device and materialized unit by unit by stage 3 equals a normal build.

Expectations are computed independently: the reference is the same model built normally (plain torch, same seed)
— optionally followed by ``model.apply(init_fn)``, which is what a Hugging Face model does after construction.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

import shardspeed
from shardspeed import zero

VOCAB, D, DEPTH = 17, 8, 3


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    """Embedding, blocks, final norm and head; ``tie`` ties head and embedding after construction, with the
    embedding registered first ("emb_first") or the head ("head_first": the shared tensor's first name is the
    head's, but the embedding created it). ``pos`` is a parameter of the root itself, initialized by the root's
    own reset_parameters() (called last in its __init__, as layers do)."""

    def __init__(self, tie: str = "none") -> None:
        super().__init__()
        if tie == "head_first":
            self.head = nn.Linear(D, VOCAB)
        self.emb = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.empty(5, D))
        self.blocks = nn.ModuleList([Block(D) for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(D)
        if tie != "head_first":
            self.head = nn.Linear(D, VOCAB)
        if tie != "none":
            self.head.weight = self.emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.pos, std=0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + self.pos[: ids.shape[-1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def hf_like_init(module: nn.Module) -> None:
    """Like a Hugging Face ``_init_weights``: per-type re-initialization through ``.data`` (random everywhere, so
    the order of random draws is visible in the result)."""
    if isinstance(module, nn.Linear):
        module.weight.data.normal_(mean=0.0, std=0.02)
        if module.bias is not None:
            module.bias.data.uniform_(-0.1, 0.1)
    elif isinstance(module, nn.Embedding):
        module.weight.data.normal_(mean=0.0, std=0.02)
    elif isinstance(module, nn.LayerNorm):
        module.weight.data.normal_(mean=1.0, std=0.1)
        module.bias.data.zero_()
    elif isinstance(module, TinyLM):
        module.pos.data.normal_(std=0.01)


def _config(threshold: int, precision: str = "fp32") -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold},
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 1000,
    }


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (2, 5), generator=g), torch.randint(0, VOCAB, (2, 5), generator=g)


def _train_two_steps(engine: shardspeed.ShardSpeedEngine) -> list[float]:
    ids, target = _batch()
    losses = []
    for _ in range(2):
        loss = F.cross_entropy(engine(ids).float().flatten(0, 1), target.flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _build_and_train(
    rank: int, world: int, tie: str, threshold: int, with_init_fn: bool, precision: str = "fp32"
) -> dict:
    torch.manual_seed(100 + rank)  # ranks draw different numbers: rank 0's must win (broadcast)
    with zero.Init(init_fn=hf_like_init if with_init_fn else None):
        model = TinyLM(tie)
    assert all(p.is_meta for p in model.parameters())
    engine, *_ = shardspeed.initialize(model=model, config=_config(threshold, precision))
    after_init = torch.rand(4)  # the generator continues where a normal build leaves it
    state = {k: v.clone() for k, v in engine.module_state_dict().items()}
    placeholders = [p.numel() for p in engine.module.parameters()]
    return {"state": state, "rand": after_init, "losses": _train_two_steps(engine), "placeholders": placeholders}


def _reference(tie: str, threshold: int, with_init_fn: bool, precision: str = "fp32") -> dict:
    torch.manual_seed(100)
    model = TinyLM(tie)
    if with_init_fn:
        model.apply(hf_like_init)
    after_init = torch.rand(4)
    engine, *_ = shardspeed.initialize(model=model, config=_config(threshold, precision))
    return {"state": engine.module_state_dict(), "rand": after_init, "losses": _train_two_steps(engine)}


def _reference_rank(rank: int, world: int, tie: str, threshold: int, with_init_fn: bool, precision: str) -> dict:
    return _reference(tie, threshold, with_init_fn, precision)


@pytest.mark.parametrize(
    ("tie", "threshold", "with_init_fn"),
    [
        ("none", 0, False),
        ("emb_first", 20, False),  # persistent small parameters: one unit spanning every block
        ("head_first", 0, False),
        ("none", 0, True),
        ("emb_first", 20, True),
        ("head_first", 0, True),
    ],
)
def test_bitwise_equal_to_normal_build(dist_run, tie: str, threshold: int, with_init_fn: bool) -> None:
    results = dist_run(_build_and_train, 2, tie, threshold, with_init_fn)
    torch.manual_seed(100)
    expected_model = TinyLM(tie)
    if with_init_fn:
        expected_model.apply(hf_like_init)
    expected_rand = torch.rand(4)
    expected = expected_model.state_dict()
    for r in results:
        assert sorted(r["state"]) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(r["state"][name], tensor), name
        assert all(n == 0 for n in r["placeholders"]) or threshold > 0
    assert torch.equal(results[0]["rand"], expected_rand)  # rank 0's generator is where a normal build leaves it
    # and training goes on from those weights exactly as from a normally built model (same engine, same steps)
    reference = dist_run(_reference_rank, 2, tie, threshold, with_init_fn, "fp32")
    assert results[0]["losses"] == reference[0]["losses"]


def test_bf16_equals_normal_build_then_cast(dist_run) -> None:
    """Initialization runs in the dtype the tensors were created in (fp32), then casts: as a normal build + cast."""
    results = dist_run(_build_and_train, 2, "emb_first", 0, True, "bf16")
    torch.manual_seed(100)
    expected_model = TinyLM("emb_first")
    expected_model.apply(hf_like_init)
    for name, tensor in expected_model.state_dict().items():
        assert results[0]["state"][name].dtype == torch.bfloat16
        assert torch.equal(results[0]["state"][name], tensor.to(torch.bfloat16)), name


class WithRandnParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.randn(4))  # no reset_parameters writes it: recorded, replayed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class WithArangeBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("positions", torch.arange(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.positions


class RMSNorm(nn.Module):
    """Like HF's LlamaRMSNorm: ``torch.ones`` in ``__init__``, no reset_parameters."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Conv1D(nn.Module):
    """Like HF's GPT-2 Conv1D: ``normal_`` on a fresh ``torch.empty`` in ``__init__``, no reset_parameters."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.flatten(0, -2), self.weight).view(*x.shape[:-1], -1)


class Rotary(nn.Module):
    """Like HF's LlamaRotaryEmbedding: a buffer-only module, ``inv_freq`` computed from ``arange``."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.inv_freq.repeat(2)


def _init_free_modules() -> nn.Module:
    return nn.ModuleDict(
        {
            "conv1d": Conv1D(8, 8),
            "rms": RMSNorm(8),
            "rotary": Rotary(8),  # a module with buffers only
            "randn": WithRandnParam(),
            "arange": WithArangeBuffer(),
        }
    )


def _hf_style_cases(rank: int, world: int, precision: str) -> dict:
    torch.manual_seed(100 + rank)
    with zero.Init():
        model = _init_free_modules()
    engine, *_ = shardspeed.initialize(model=model, config=_config(0, precision))
    state = {k: v.clone() for k, v in engine.module_state_dict().items()}
    state.update({k: v.clone() for k, v in engine.module.named_buffers()})
    return state


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_values_set_in_init_without_reset_parameters(dist_run, precision: str) -> None:
    """torch.ones / normal_ in __init__ (HF's RMSNorm, GPT-2's Conv1D), a randn parameter, an arange buffer, a
    buffer-only module (rotary inv_freq, also under bf16): each equal to a normal build (then cast), with no
    init_fn. Used to raise UninitializedTensorError (and inv_freq stayed unwritten under bf16)."""
    state = dist_run(_hf_style_cases, 2, precision)[1]
    torch.manual_seed(100)
    model = _init_free_modules()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    expected = dict(model.state_dict())
    expected.update(dict(model.named_buffers()))
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert state[name].dtype == tensor.dtype, name
        assert torch.equal(state[name], tensor), name


def _head_then_embedding() -> nn.Module:
    return nn.ModuleDict({"head": nn.Linear(D, VOCAB, bias=False), "emb": nn.Embedding(VOCAB, D)})


def _tied_after_the_block(rank: int, world: int) -> dict:
    torch.manual_seed(100 + rank)
    with zero.Init():
        model = _head_then_embedding()
    model["head"].weight = model["emb"].weight  # outside the block: head's own recorded tensor is discarded
    engine, *_ = shardspeed.initialize(model=model, config=_config(0))
    return {k: v.clone() for k, v in engine.module_state_dict().items()}


def test_tie_made_after_the_block_takes_the_creators_value(dist_run) -> None:
    state = dist_run(_tied_after_the_block, 2)[0]
    torch.manual_seed(100)
    model = _head_then_embedding()
    model["head"].weight = model["emb"].weight
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name


class WithEmptyParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.empty(4))  # nobody ever writes it: no values in a normal build either

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class WithEmptyBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("positions", torch.empty(4, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.positions


def _build_uninitialized(rank: int, world: int, kind: str) -> None:
    with zero.Init():
        model = WithEmptyParam() if kind == "param" else WithEmptyBuffer()
    shardspeed.initialize(model=model, config=_config(0))


@pytest.mark.parametrize(("kind", "name"), [("param", "'scale'"), ("buffer", "'positions'")])
def test_unwritten_tensor_is_an_error_naming_it(dist_run, kind: str, name: str) -> None:
    with pytest.raises(AssertionError) as failure:
        dist_run(_build_uninitialized, 2, kind)
    messages = failure.value.messages()
    assert len(messages) == 2  # every rank raises the same error: nobody hangs
    for message in messages:
        assert name in message and "never initialized" in message and "init_fn" in message, message


def _build_unreplayable(rank: int, world: int, case: str) -> None:
    if case == "outside":  # a buffer computed from a meta tensor made outside the block: nothing recorded it
        outside = torch.ones(4, device="meta")
        with zero.Init():
            model = WithArangeBuffer()
            model.register_buffer("offsets", outside * 2)
    else:  # written in place on the meta device after the block: the write was not recorded
        with zero.Init():
            model = WithArangeBuffer()
        with torch.no_grad():
            model.lin.weight.zero_()
    shardspeed.initialize(model=model, config=_config(0))


@pytest.mark.parametrize(
    ("case", "names"), [("outside", ["'offsets'", "outside"]), ("after", ["'lin.weight'", "after"])]
)
def test_unreplayable_value_is_an_error_naming_it(dist_run, case: str, names: list[str]) -> None:
    with pytest.raises(AssertionError) as failure:
        dist_run(_build_unreplayable, 2, case)
    messages = failure.value.messages()
    assert len(messages) == 2
    for message in messages:
        assert "zero.Init" in message and all(n in message for n in names), message


def _batchnorm_and_fixed_buffer(rank: int, world: int) -> dict:
    def init_fn(module: nn.Module) -> None:  # re-creates the buffer its __init__ computed on the meta device
        if isinstance(module, WithArangeBuffer):
            module.positions = torch.arange(4)

    torch.manual_seed(3)
    with zero.Init(init_fn=init_fn):
        model = nn.Sequential(WithArangeBuffer(), nn.BatchNorm1d(4))
    engine, *_ = shardspeed.initialize(model=model, config=_config(0))
    return {k: v.clone() for k, v in engine.module_state_dict().items()}


def test_buffers_rewritten_by_reset_or_init_fn(dist_run) -> None:
    """BatchNorm's running stats are re-created by its reset_parameters(); a computed buffer by the init_fn."""
    state = dist_run(_batchnorm_and_fixed_buffer, 2)[1]
    torch.manual_seed(3)
    expected = nn.Sequential(WithArangeBuffer(), nn.BatchNorm1d(4)).state_dict()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def test_disabled_init_is_a_normal_build() -> None:
    with zero.Init(enabled=False):
        model = nn.Linear(2, 3)
    assert model.weight.device.type == "cpu"
    with zero.Init():
        model = nn.Linear(2, 3)
    assert model.weight.is_meta
    assert torch.empty(1).device.type == "cpu"  # the context is gone after the block


def test_init_refuses_a_config_for_another_stage() -> None:
    with pytest.raises(ValueError, match=r"stage is 2"):
        zero.Init(config_dict_or_path={"zero_optimization": {"stage": 2}})
    zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}})


WIDTH, LAYERS = 48, 32


def _construction_peak(rank: int, world: int, frozen: bool) -> dict:
    tracker = MemTracker()
    with tracker:
        torch.manual_seed(0)
        with zero.Init():
            model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)], nn.Linear(WIDTH, 1))
            if frozen:  # no gradient shards for the big layers: the bound is the parameter shards + one unit
                model[:LAYERS].requires_grad_(False)
        engine, *_ = shardspeed.initialize(model=model, config=_config(0))
        cpu = torch.device("cpu")
        peak = tracker.get_tracker_snapshot("peak")[cpu]["Total"]
        current = tracker.get_tracker_snapshot("current")[cpu]["Total"]
    largest_unit = max(u.padded_numel * u.shard.element_size() for u in engine.states.units)
    return {"peak": peak, "kept": current, "largest_unit": largest_unit}


@pytest.mark.parametrize("frozen", [False, True])
def test_construction_peak_is_shards_plus_one_unit(dist_run, frozen: bool) -> None:
    """Peak tracked bytes while building and materializing ≤ what the engine keeps (parameter shards, and
    gradient shards of trainable layers) + the largest unit, + 10% — on a model whose full size is several times
    that bound. With the big layers frozen, two units alive at once would already exceed it."""
    world = 8
    full_bytes = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    for r in dist_run(_construction_peak, world, frozen):
        bound = r["kept"] + r["largest_unit"]
        assert full_bytes >= 3 * bound * 1.1, (full_bytes, bound)
        assert r["peak"] <= 1.1 * bound, r
