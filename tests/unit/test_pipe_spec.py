"""LayerSpec / TiedLayerSpec and a one-process PipelineModule: what is built, under which names, seeded per global
layer; tied occurrences share one module; activation checkpointing every k layers; clear errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardspeed.params import ParamSpec
from shardspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from shardspeed.pipe.spec import layer_class_name, trainable_numel


def test_layer_spec_builds_on_demand() -> None:
    spec = LayerSpec(nn.Linear, 3, 4, bias=False)
    assert repr(spec) == "Linear(3, 4, bias=False)"
    first, second = spec.build(), spec.build()
    assert first is not second and first.weight.shape == (4, 3) and first.bias is None
    assert trainable_numel(spec) == 12 and layer_class_name(spec) == "Linear"
    with pytest.raises(TypeError, match=r"LayerSpec takes an nn.Module subclass, got <function"):
        LayerSpec(lambda: nn.Linear(2, 2))


def test_tied_spec_arguments() -> None:
    spec = TiedLayerSpec("embed", nn.Embedding, 5, 2, tied_weight_attr="weight")
    assert spec.tied_weight_attr == ["weight"] and spec.key == "embed" and spec.forward_fn is None
    with pytest.raises(ValueError, match=r"key 'a.b': expected a non-empty string without dots"):
        TiedLayerSpec("a.b", nn.Embedding, 5, 2)


class Counted(nn.Linear):
    built = 0

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        if not self.weight.is_meta:
            Counted.built += 1


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def _head(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight.t()


def _layers() -> list[Any]:
    return [
        TiedLayerSpec("embed", nn.Embedding, 9, 4),
        LayerSpec(Counted, 4, 4),
        Scale(),
        lambda x: x + 1,
        LayerSpec(Counted, 4, 4),
        TiedLayerSpec("embed", nn.Embedding, 9, 4, forward_fn=_head),
    ]


def test_one_stage_builds_each_layer_once_under_its_global_index() -> None:
    Counted.built = 0
    module = PipelineModule(_layers(), num_stages=1)
    assert Counted.built == 2  # partition counting builds on meta only
    assert [n for n, _ in module.named_parameters()] == [
        "tied_modules.embed.weight",
        "1.weight",
        "1.bias",
        "4.weight",
        "4.bias",
    ]
    assert module.parts == [0, 6] and module.chunk_layers() == list(range(6))
    assert module.num_stages == 1 and module.stage_id == 0 and module.stage_owner(5) == 0
    [tie] = module.tied_weights()
    assert (tie.key, tie.names, tie.stages, tie.owner, tie.axis.group) == (
        "embed",
        ("tied_modules.embed.weight",),
        (0,),
        0,
        None,
    )
    assert module.tied_copy_names() == frozenset()
    ids = torch.tensor([[1, 2, 3]])
    emb = module.tied_modules["embed"]
    expected = _head(emb, module.get_submodule("4")(2 * module.get_submodule("1")(emb(ids)) + 1))
    assert torch.equal(module(ids), expected)


def test_seed_layers_seeds_each_build_by_global_index() -> None:
    a = PipelineModule(_layers(), num_stages=1, seed_layers=True, base_seed=11)
    torch.manual_seed(0)
    b = PipelineModule(_layers(), num_stages=1, seed_layers=True, base_seed=11)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    torch.manual_seed(11 + 4)
    assert torch.equal(a.get_submodule("4").weight, Counted(4, 4).weight)  # layer 4 built under seed 11 + 4
    seeds: list[int] = []
    PipelineModule(_layers(), num_stages=1, seed_layers=True, base_seed=100, seed_fn=seeds.append)
    # the tied key's second occurrence (layer 5) gets its first occurrence's seed: the copies start equal
    assert seeds == [100, 101, 102, 103, 104, 100]


def test_forward_passes_tuples_between_layers() -> None:
    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, (x > 0).long()  # an integer mask travels along

    def merge(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return pair[0] * pair[1]

    module = PipelineModule([LayerSpec(nn.Linear, 3, 3), split, merge], num_stages=1, partition_method="uniform")
    x = torch.randn(2, 3)
    lin = module.get_submodule("0")
    assert torch.equal(module(x), lin(x) * (lin(x) > 0).long())


def test_activation_checkpointing_every_k_layers() -> None:
    calls: list[list[str]] = []

    def recording_checkpoint(function: Any, *args: Any) -> Any:
        calls.append([type(a).__name__ for a in args])
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    layers = [LayerSpec(nn.Linear, 3, 3), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 3, 3), lambda x: x * 2, Scale()]
    torch.manual_seed(0)
    plain = PipelineModule(layers, num_stages=1)
    torch.manual_seed(0)
    checkpointed = PipelineModule(
        layers, num_stages=1, activation_checkpoint_interval=2, activation_checkpoint_func=recording_checkpoint
    )
    x = torch.randn(4, 3, requires_grad=True)
    plain(x).sum().backward()
    grads = [p.grad.clone() for p in plain.parameters()]
    out = checkpointed(x)
    out.sum().backward()
    # ranges [0, 1] and [2, 3] hold parameters and are recomputed; [4] (parameter-free) is not
    assert calls == [["Tensor"], ["Tensor"]]
    assert torch.allclose(out, plain(x)) and all(
        torch.allclose(p.grad, g) for p, g in zip(checkpointed.parameters(), grads, strict=True)
    )
    calls.clear()
    only_scale = PipelineModule(
        layers,
        num_stages=1,
        activation_checkpoint_interval=1,
        activation_checkpoint_func=recording_checkpoint,
        checkpointable_layers=["Scale", "Tanh"],
    )
    only_scale(x)
    assert len(calls) == 2  # the Tanh and the Scale layer only


def test_default_checkpoint_func_is_shardspeeds() -> None:
    from shardspeed import checkpointing

    module = PipelineModule([LayerSpec(nn.Linear, 2, 2)], num_stages=1, activation_checkpoint_interval=1)
    assert module.activation_checkpoint_func is checkpointing.checkpoint
    x = torch.randn(3, 2)
    module(x).sum().backward()
    assert module.get_submodule("0").weight.grad is not None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, r"needs num_stages or topology"),
        ({"num_stages": 2}, ValueError, r"num_stages=2 does not divide the world size 1"),
        ({"num_stages": 0}, ValueError, r"num_stages=0: expected a positive integer"),
        ({"num_stages": 1, "virtual_stages": 0}, ValueError, r"virtual_stages=0"),
        ({"num_stages": 1, "activation_checkpoint_interval": -1}, ValueError, r"activation_checkpoint_interval=-1"),
        ({"num_stages": 1, "checkpointable_layers": "Linear"}, TypeError, r"expected a list of class names"),
        ({"num_stages": 1, "virtual_stages": 4}, ValueError, r"3 layers cannot fill 4 pipeline parts"),
        ({"num_stages": 1, "partition_method": "type:Conv"}, ValueError, r"'type:Conv' matches no layer"),
    ],
)
def test_bad_arguments_name_the_culprit(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    layers = [LayerSpec(nn.Linear, 2, 2), LayerSpec(nn.Linear, 2, 2), LayerSpec(nn.Linear, 2, 2)]
    with pytest.raises(error, match=match):
        PipelineModule(layers, **kwargs)


def test_bad_layers_and_chunks() -> None:
    with pytest.raises(TypeError, match=r"layer 1 is a int: expected a LayerSpec, nn.Module or callable"):
        PipelineModule([LayerSpec(nn.Linear, 2, 2), 3], num_stages=1, partition_method="uniform")
    with pytest.raises(ValueError, match=r"tied key 'e': layer 1 is Linear tying \['bias'\], layer 0 is Linear tying"):
        PipelineModule(
            [TiedLayerSpec("e", nn.Linear, 2, 2), TiedLayerSpec("e", nn.Linear, 2, 2, tied_weight_attr="bias")],
            num_stages=1,
        )
    with pytest.raises(ValueError, match=r"tied_weight_attr 'weights' reaches no parameter .*\['bias', 'weight'\]"):
        PipelineModule([TiedLayerSpec("e", nn.Linear, 2, 2, tied_weight_attr="weights")], num_stages=1)
    module = PipelineModule([LayerSpec(nn.Linear, 2, 2)], num_stages=1)
    with pytest.raises(ValueError, match=r"chunk 1 out of range: this module has 1 chunk\(s\) per rank"):
        module(torch.zeros(1, 2), chunk=1)


def test_a_layer_replaced_after_construction_is_the_one_that_runs() -> None:
    module = PipelineModule([LayerSpec(nn.Linear, 2, 2), Scale()], num_stages=1, partition_method="uniform")
    setattr(module, "0", nn.Identity())  # as AutoTP swaps a layer for its parallel version
    setattr(module, "1", Scale())
    x = torch.randn(3, 2)
    assert torch.equal(module(x), 2 * x)


def test_built_under_zero_init_equals_a_plain_build() -> None:
    """Counting parameters builds every layer on meta inside ``zero.Init`` too; the recorded initialization (and so
    the materialized stage-3 model) must still be bitwise the plain build's."""
    import shardspeed

    plain = PipelineModule(_layers(), num_stages=1, seed_layers=True)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    with shardspeed.zero.Init(config_dict_or_path=config):
        lazy = PipelineModule(_layers(), num_stages=1, seed_layers=True)
    engine, *_ = shardspeed.initialize(model=lazy, model_parameters=lazy.parameters(), config=config)
    materialized = engine.state_dict()
    assert all(torch.equal(materialized[f"module.{name}"], value) for name, value in plain.state_dict().items())
    engine.destroy()


class EmbeddingPipe(nn.Module):
    """Megatron-DeepSpeed's shape: the tied weight reached through a property, positions beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(9, 4)
        self.positions = nn.Parameter(torch.zeros(3, 4))

    @property
    def word_embeddings_weight(self) -> nn.Parameter:
        return self.word_embeddings.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(ids) + self.positions[: ids.shape[-1]]


def test_tied_weight_attr_may_be_a_property_or_a_dotted_path() -> None:
    for attr in ("word_embeddings_weight", "word_embeddings.weight"):
        module = PipelineModule([TiedLayerSpec("embed", EmbeddingPipe, tied_weight_attr=attr)], num_stages=1)
        # the attribute first, then the module's other trainable parameters: the whole module is shared
        assert module.tied_weights()[0].names == (
            "tied_modules.embed.word_embeddings.weight",
            "tied_modules.embed.positions",
        )


class HalfOfALinear(nn.Module):
    """A tensor-parallel slice as tensor rank ``rank`` of 2 holds it: rows split in ceil chunks of 5 → 3 and 2."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3 - rank, 4))

    def tensor_parallel_specs(self) -> dict[str, ParamSpec]:
        return {"weight": ParamSpec((5, 4), partition_dim=0)}


def test_tensor_parallel_slices_count_their_global_size() -> None:
    """Partitions must agree over the tensor axis (and with the dense model) even when slices differ in size."""
    assert trainable_numel(LayerSpec(HalfOfALinear, 0)) == trainable_numel(LayerSpec(HalfOfALinear, 1)) == 20
    assert trainable_numel(HalfOfALinear(1)) == 20


def test_first_occurrences_are_each_tied_keys_first_global_index() -> None:
    from shardspeed.pipe.tied import first_occurrences

    layers = [LayerSpec(Counted, 4, 4), *_layers(), TiedLayerSpec("other", nn.Linear, 2, 2)]
    assert first_occurrences(layers) == {"embed": 1, "other": 7}
