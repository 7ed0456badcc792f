"""zero.Init's recording and replay (init_record.py, init_replay.py), one process, no engine: each recorded value
replayed on its own equals the same module built normally with the same seed, and the generator ends where a normal
build leaves it. (The engine path — materialization per unit, broadcast, bf16 — is tests/dist/test_zero3_init*.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardspeed import zero
from shardspeed.zero.stage3.init import recorded_value
from shardspeed.zero.stage3.init_record import UnreplayableInitError
from shardspeed.zero.stage3.init_replay import Replayer, preserved_rng


def _replayed(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for path, module in model.named_modules():
        for attr, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is None:
                continue
            recorded = recorded_value(module, attr)
            assert recorded is not None and recorded.recorded, (path, attr)
            with preserved_rng():
                out[f"{path}.{attr}" if path else attr] = Replayer(recorded.recording).value(recorded.ref)
    return out


def _normal_state(model: nn.Module) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    state.update(dict(model.named_buffers()))
    return state


def _check_equal_to_normal_build(build) -> None:
    torch.manual_seed(5)
    expected = _normal_state(build())
    expected_rand = torch.rand(3)
    torch.manual_seed(5)
    with zero.Init():
        model = build()
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert torch.equal(torch.rand(3), expected_rand)  # the block advanced the generator as a normal build does
    replayed = _replayed(model)
    assert sorted(replayed) == sorted(expected)
    for name, tensor in expected.items():
        assert replayed[name].dtype == tensor.dtype, name
        assert torch.equal(replayed[name], tensor), name


class Inits(nn.Module):
    """torch.nn.init functions that end in different aten ops (trunc_normal_: uniform_, erfinv_, mul_, add_,
    clamp_; orthogonal_: a QR decomposition), a partial write (HF's padding_idx row), a copy_ from another
    recorded tensor, a view registered as a buffer, constants from Python and numpy, an explicit generator."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(6, 5))
        nn.init.trunc_normal_(self.a, std=0.5, a=-0.4, b=0.4)
        self.b = nn.Parameter(torch.empty(5, 5))
        nn.init.orthogonal_(self.b)
        self.emb = nn.Embedding(7, 3, padding_idx=2)
        with torch.no_grad():
            self.emb.weight.data.normal_(std=0.02)
            self.emb.weight.data[self.emb.padding_idx].zero_()
        self.c = nn.Parameter(torch.empty(6, 5))
        with torch.no_grad():
            self.c.copy_(self.a * 2 + 1)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4, dtype=torch.bool)).view(1, 1, 4, 4))
        self.register_buffer("scalar", torch.tensor(-1e4))
        self.register_buffer("from_numpy", torch.tensor(np.linspace(0.0, 1.0, 5), dtype=torch.float32))
        generator = torch.Generator().manual_seed(3)
        self.d = nn.Parameter(torch.randn(4, generator=generator))
        self.lin = nn.Linear(3, 3)
        nn.init.xavier_uniform_(self.lin.weight)


def test_init_ops_replay_bitwise() -> None:
    _check_equal_to_normal_build(Inits)


def test_nested_init_records_once() -> None:
    """Nested blocks share the outer recording: a random op advances the generator once, not once per block."""

    def build() -> nn.Module:
        with zero.Init():
            inner = nn.Linear(3, 3)
        return nn.Sequential(inner, nn.Linear(3, 2))

    torch.manual_seed(5)
    expected = _normal_state(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)))
    expected_rand = torch.rand(3)
    torch.manual_seed(5)
    with zero.Init():
        model = build()
    assert torch.equal(torch.rand(3), expected_rand)
    replayed = _replayed(model)
    for name, tensor in expected.items():
        assert torch.equal(replayed[name], tensor), name


class _CountRandomOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_overwritten_initialization_is_not_replayed() -> None:
    """nn.Linear's kaiming uniform_ then an HF-style normal_: replay runs only the normal_ (each random op has its
    own generator snapshot, so skipping dead writes changes no number): one random op per tensor."""
    torch.manual_seed(0)
    with zero.Init():
        model = nn.Linear(4, 4)
        with torch.no_grad():
            model.weight.data.normal_(std=0.02)
            model.bias.data.normal_(std=0.02)
    counter = _CountRandomOps()
    with counter:
        replayed = _replayed(model)
    assert counter.ops == ["normal_", "normal_"]
    torch.manual_seed(0)
    expected = nn.Linear(4, 4)
    with torch.no_grad():
        expected.weight.normal_(std=0.02)
        expected.bias.normal_(std=0.02)
    assert torch.equal(replayed["weight"], expected.weight) and torch.equal(replayed["bias"], expected.bias)


class ItemInInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.n = int(self.w.sum().item())  # a meta tensor's value into Python: cannot be replayed


class NumpyInInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("x", torch.arange(3.0))
        self.values = self.x.numpy()


@pytest.mark.parametrize("cls", [ItemInInit, NumpyInInit])
def test_meta_value_into_python_is_an_error_naming_the_module(cls: type[nn.Module]) -> None:
    with pytest.raises(UnreplayableInitError, match=rf"in {cls.__name__}\.__init__"), zero.Init():
        cls()
    assert torch.empty(1).device.type == "cpu"  # the context is gone after the error


@pytest.mark.parametrize("kind", ["bert", "vit"])
def test_more_hf_models_replay_bitwise(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """BERT (position_ids / token_type_ids buffers from arange / zeros, a tied decoder bias) and ViT (HF's
    _init_weights through trunc_normal_, one of torch's meta shortcuts) from small configs."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if kind == "bert":
        config = transformers.BertConfig(
            num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=40,
            max_position_embeddings=12,
        )  # fmt: skip
        _check_equal_to_normal_build(lambda: transformers.AutoModelForMaskedLM.from_config(config))
    else:
        config = transformers.ViTConfig(
            num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2, image_size=8, patch_size=4
        )
        _check_equal_to_normal_build(lambda: transformers.AutoModel.from_config(config))


class ResizedBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        grown = torch.empty(0)
        grown.resize_(3)  # the storage itself changes: values are keyed by storage, so this cannot be replayed
        grown.fill_(2.0)
        self.register_buffer("grown", grown)


def test_storage_changing_op_is_an_error_naming_the_tensor() -> None:
    from shardspeed.zero.stage3.init_replay import ReplaySession

    with zero.Init():
        model = ResizedBuffer()
    recorded = recorded_value(model, "grown")
    assert recorded is not None
    with pytest.raises(UnreplayableInitError, match=r"buffer 'grown' of ResizedBuffer .*resize_"):
        ReplaySession().fill(recorded, torch.empty(3), "buffer", "grown", model)


def test_scratch_pool_reuses_one_buffer_across_random_ops() -> None:
    """Random ops run only to advance the generator draw into one reused host buffer ([Note: init recording]):
    one allocation per size increase, not one per op (per-op multi-MiB frees fragmented glibc's heap)."""
    from shardspeed.zero.stage3.init_record import ScratchPool

    pool = ScratchPool()
    storages = set()
    for _ in range(5):
        pool.reset(ScratchPool.nbytes_of([torch.empty(32, 32)]))
        a = pool.take((32, 32), (32, 1), torch.float32)
        storages.add(a.untyped_storage().data_ptr())
        a.normal_()
    assert len(storages) == 1
    pool.reset(ScratchPool.nbytes_of([torch.empty(4, 4), torch.empty(8, dtype=torch.bfloat16)]))
    a, b = pool.take((4, 4), (1, 4), torch.float32), pool.take((8,), (1,), torch.bfloat16)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == next(iter(storages))
    assert b.data_ptr() - a.data_ptr() >= 16 * 4  # disjoint regions
    c = pool.take((1024,), (1,), torch.float32)  # more than reset() was told of: a fresh tensor, still correct
    assert c.untyped_storage().data_ptr() != a.untyped_storage().data_ptr() and c.shape == (1024,)
    pool.release()
    assert pool._buffer.numel() == 0  # the block is over: nothing kept through materialization
