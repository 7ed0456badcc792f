"""ZeRO-3 leaf modules: a mixture-of-experts layer whose router sends each rank's tokens to different experts.

Without a leaf every expert is its own unit (a child of a ModuleList), so ranks gather different units at the same
point and the unit-id check raises UnitMismatchError. With the MoE layer as a leaf — by
``shardspeed.utils.set_z3_leaf_modules``, by the config's ``leaf_module``, or by
``stage3_module_granularity_threshold`` — the layer is one unit gathered whole before the router runs, and training
matches plain torch on the whole batch (experts no rank used get zero gradients, as in the reference).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardspeed
from harness import RankFailure
from shardspeed.utils import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
from shardspeed.zero.stage3.leaves import granularity, granularity_leaves, leaf_paths
from shardspeed.zero.stage3.plan import plan_units

D, E, IN, OUT = 8, 4, 32, 32
STEPS, MB = 4, 4
THRESHOLD = 90  # between the MoE layer's granularity (82) and the whole model's (100): see test_granularity
ADAM = {"lr": 0.01, "weight_decay": 0.01, "eps": 1e-6}
SGD = {"lr": 0.1, "momentum": 0.9}


class Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(D, 2 * D)
        self.down = torch.nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class MoE(torch.nn.Module):
    """Top-1 routing; an expert that gets no token does not run (data-dependent control flow)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(D, E)
        self.experts = torch.nn.ModuleList(Expert() for _ in range(E))
        self.used: list[list[int]] = []  # experts that ran, per forward (for the test)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x), dim=-1)
        choice = probs.argmax(dim=-1)
        gate = probs.gather(1, choice[:, None])
        out = torch.zeros_like(x)
        used = []
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(1)
            if rows.numel():
                used.append(e)
                out = out.index_add(0, rows, expert(x[rows]) * gate[rows])
        self.used.append(used)
        return out


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(IN, D)
        self.moe = MoE()
        self.head = torch.nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = h + self.moe(h)
        return F.mse_loss(self.head(h), y)


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)  # step 0 routes rank 0 to experts [0, 2], rank 1 to [1, 2]
    return [(torch.randn(MB * world, IN, generator=g), torch.randn(MB * world, OUT, generator=g)) for _ in range(STEPS)]


def _config(kind: str, **zero: object) -> dict:
    optimizer = {"type": "AdamW", "params": ADAM} if kind == "adamw" else {"type": "SGD", "params": SGD}
    return {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": optimizer,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 8, **zero},
        "steps_per_print": 1000,
    }


HOW = {
    "set_z3_leaf_modules": {},
    "zero_init": {},  # built under zero.Init (meta device), flagged before initialize
    "config_classes": {"leaf_module": {"classes": ["MoE"]}},
    "config_names": {"leaf_module": {"names": ["moe"]}},
    "granularity_threshold": {"stage3_module_granularity_threshold": THRESHOLD},
    "none": {},
}


def _train(rank: int, world: int, how: str, kind: str) -> dict:
    if how == "zero_init":
        torch.manual_seed(0)
        with shardspeed.zero.Init():
            model = Net()
    else:
        model = make_net()
    if how in ("set_z3_leaf_modules", "zero_init"):
        set_z3_leaf_modules(model, [MoE])
    engine, *_ = shardspeed.initialize(model=model, config=_config(kind, **HOW[how]))
    for x, y in batches(world):
        rows = slice(rank * MB, (rank + 1) * MB)
        engine.backward(engine(x[rows], y[rows]))
        engine.step()
    return {
        "state": engine.module_state_dict(),
        "used": model.moe.used,
        "leaf_units": engine.states.leaf_units,
        "units": [u.name for u in engine.states.units],
    }


def _reference(kind: str, world: int) -> dict[str, torch.Tensor]:
    model = make_net()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, **ADAM) if kind == "adamw" else torch.optim.SGD(params, **SGD)
    for x, y in batches(world):
        opt.zero_grad()
        model(x, y).backward()
        for p in params:  # experts no token reached: zero gradients, as ZeRO-3 reduces them
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    ("how", "kind"),
    [
        ("set_z3_leaf_modules", "adamw"),
        ("set_z3_leaf_modules", "sgd"),
        ("config_classes", "adamw"),
        ("config_names", "sgd"),
        ("granularity_threshold", "adamw"),
        ("zero_init", "sgd"),
    ],
)
def test_moe_leaf_trains_with_parity(dist_run, how: str, kind: str) -> None:
    results = dist_run(_train, 2, how, kind)
    # the routing really differs between ranks (else the test proves nothing)
    assert results[0]["used"][0] == [0, 2] and results[1]["used"][0] == [1, 2]
    ref = _reference(kind, 2)
    initial = make_net().state_dict()
    assert max((ref[k] - initial[k]).abs().max().item() for k in ref) >= 1e-3
    for r in results:
        assert r["leaf_units"] == ["moe"]
        assert r["units"] == ["<persistent>", "embed", "moe", "head"]  # the experts are no units of their own
        for name, value in r["state"].items():
            assert (value - ref[name]).abs().max().item() <= 1e-5, name


def test_moe_without_leaf_is_a_unit_mismatch(dist_run) -> None:
    with pytest.raises(RankFailure) as failure:
        dist_run(_train, 2, "none", "sgd")
    assert sorted(failure.value.errors) == [0, 1]
    for kind, message, _ in failure.value.errors.values():
        assert kind == "UnitMismatchError", message
        assert "reached unit 'moe.experts." in message


def test_granularity() -> None:
    """DeepSpeed's rule: elements per layer of a subtree; containers and torch leaves never qualify."""
    values = granularity(make_net())
    assert values[""] == 100 and values["moe"] == 82 and values["moe.experts.0"] == 93
    assert values["moe.experts"] > 10**9 and values["embed"] > 10**9
    assert granularity_leaves(make_net(), THRESHOLD) == ["moe"]
    assert granularity_leaves(make_net(), 100) == [""]  # the root qualifies first: everything is one unit
    assert granularity_leaves(make_net(), 0) == []
    plan = plan_units(make_net(), 0, [""])
    assert [u.name for u in plan.units] == [""] and plan.units[0].data_dependent


def test_leaf_flags_live_in_a_registry() -> None:
    model = make_net()
    assert set_z3_leaf_modules(model, ["MoE"]) == [model.moe]
    assert z3_leaf_module(model.moe) and not z3_leaf_module(model.embed)
    assert get_z3_leaf_modules(model) == [model.moe]
    assert z3_leaf_parameter(model.moe.experts[1].up.weight) and not z3_leaf_parameter(model.head.weight)
    assert "_z3_leaf" not in vars(model.moe)  # nothing written on the module (nor its parameters)
    assert leaf_paths(model) == ["moe"]
    assert unset_z3_leaf_modules(model, [MoE]) == [model.moe]
    assert get_z3_leaf_modules(model) == [] and leaf_paths(model) == []
    with pytest.raises(ValueError, match="no module of class"):
        set_z3_leaf_modules(model, ["Mixtral"])
    with pytest.raises(ValueError, match="no module named"):
        leaf_paths(model, names=["moe.nope"])
    assert leaf_paths(model, name_suffixes=["experts.1"]) == ["moe.experts.1"]
    assert leaf_paths(model, classes=["tests.Nope", f"{MoE.__module__}.MoE"]) == ["moe"]


def _flag_after_initialize(rank: int, world: int) -> str:
    from harness import error_of

    model = make_net()
    shardspeed.initialize(model=model, config=_config("sgd"))
    return error_of(lambda: set_z3_leaf_modules(model, [MoE]))


def test_flagging_after_initialize_is_an_error(dist_run) -> None:
    for message in dist_run(_flag_after_initialize, 2):
        assert message.startswith("RuntimeError: set_z3_leaf_modules on MoE after shardspeed.initialize()")


class _TiedInsideLeaf(torch.nn.Module):
    """An expert inside the MoE layer uses a weight owned by a module outside it (registered first: it owns it)."""

    def __init__(self) -> None:
        super().__init__()
        self.out = torch.nn.Linear(2 * D, D)
        self.moe = MoE()
        self.moe.experts[3].down.weight = self.out.weight


def test_tied_weight_inside_a_leaf_is_gathered_around_the_leaf() -> None:
    """The expert may not run on every rank, so the other unit is gathered around the whole leaf, not the expert."""
    plain = plan_units(_TiedInsideLeaf(), 0)
    assert plain.foreign == {"moe.experts.3.down": [plain.roots["out"]]}
    leaf = plan_units(_TiedInsideLeaf(), 0, ["moe"])
    assert leaf.foreign == {"moe": [leaf.roots["out"]]}
