"""The overlapped parameter gather's pure helpers and state machine (zero/param_gather.py), without processes."""

from __future__ import annotations

import pytest
import torch

from shardspeed.zero.param_gather import (
    BucketGather,
    GatherPhase,
    ParamGather,
    buckets_of_params,
    hooked_modules,
    launch_order,
    module_buckets,
    owned_by,
    settle_waits,
)


class FakeWork:
    def __init__(self, log: list[int], k: int) -> None:
        self.log, self.k = log, k

    def wait(self) -> None:
        self.log.append(self.k)


def test_buckets_of_params() -> None:
    spans = [(0, 4), (4, 10), (12, 20), (20, 20)]  # the last: an empty parameter
    buckets = [(0, 10), (10, 12), (12, 24)]
    assert buckets_of_params(spans, buckets) == [(0,), (0,), (2,), ()]
    assert buckets_of_params([(5, 15)], [(0, 10), (10, 20)]) == [(0, 1)]  # straddling (not made by the layout)


def test_module_buckets_and_launch_order() -> None:
    per_param = [(2,), (2,), (1,), (0,), (0, 1)]
    assert module_buckets([[0, 1], [2, 4], [3], []], per_param) == [(2,), (0, 1), (0,), ()]
    assert launch_order(4) == [3, 2, 1, 0]  # backward arrival order reversed: the forward's first bucket first
    assert launch_order(0) == []


def test_owners_list_tied_parameters_under_each_owner() -> None:
    root = torch.nn.Module()
    root.embed = torch.nn.Embedding(5, 3)
    root.head = torch.nn.Linear(3, 5, bias=False)
    root.head.weight = root.embed.weight
    root.scale = torch.nn.Parameter(torch.ones(1))
    params = [root.scale, root.embed.weight]
    hooked = hooked_modules(root, params)
    owners = {type(m).__name__: idx for m, idx in zip(hooked, owned_by(hooked, params), strict=True)}
    assert owners == {"Module": [0], "Embedding": [1], "Linear": [1]}


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Linear(2, 2))


def test_state_machine_waits_per_bucket_in_forward() -> None:
    model = _model()
    params = list(model.parameters())  # 0: w0, 1: b0, 2: w1, 3: b1
    gather = ParamGather(model, params)
    # bucket 0 holds the last layer (backward arrival order), bucket 1 the first
    gather.bind([(6, 10), (10, 12), (0, 4), (4, 6)], [(0, 6), (6, 12)])
    assert gather.phase is GatherPhase.IDLE and gather.pending == 0
    model(torch.ones(1, 2))  # the recording forward: every owner's pre-hook fires
    log: list[int] = []
    for k in launch_order(2):
        gather.launch(k, FakeWork(log, k), torch.zeros(1))
    assert gather.phase is GatherPhase.LAUNCHED and gather.pending_buckets() == [0, 1]
    seen = []
    model[2].register_forward_pre_hook(lambda m, a: seen.append(gather.pending_buckets()))
    model(torch.ones(1, 2))
    assert log == [1, 0]  # the first layer's bucket, then the second's, each in its module's pre-hook
    assert seen == [[]]  # the second layer ran with its bucket landed
    assert gather.phase is GatherPhase.IDLE and gather.waited == [1, 0]
    model(torch.ones(1, 2))  # nothing pending: hooks return at once
    assert log == [1, 0]


def test_root_forward_lands_unused_buckets_and_hooks_are_removed() -> None:
    model = _model()
    extra = torch.nn.Parameter(torch.zeros(3))  # read by nobody: no owning module in the model
    params = [*model.parameters(), extra]
    gather = ParamGather(model, params)
    gather.bind([(0, 4), (4, 6), (6, 10), (10, 12), (12, 15)], [(0, 12), (12, 16)])
    model(torch.ones(1, 2))  # the recording forward
    log: list[int] = []
    for k in launch_order(2):
        gather.launch(k, FakeWork(log, k), torch.zeros(1))
    model(torch.ones(1, 2))
    assert log == [0, 1]  # bucket 0 by the first layer, bucket 1 when the root forward returned
    gather.remove_hooks()
    gather.launch(0, FakeWork(log, 0), torch.zeros(1))
    model(torch.ones(1, 2))
    assert gather.pending == 1  # no hooks any more
    gather.wait_all()
    gather.wait_all()  # idempotent
    assert log == [0, 1, 0] and gather.phase is GatherPhase.IDLE


def test_launch_twice_and_relayout_while_pending_are_refused() -> None:
    gather = ParamGather(None, [])
    gather.bind([], [(0, 4)])
    gather.launch(0, FakeWork([], 0), torch.zeros(1))
    assert gather._buckets[0] is BucketGather.PENDING
    with pytest.raises(AssertionError, match="pending"):
        gather.launch(0, FakeWork([], 0), torch.zeros(1))
    with pytest.raises(AssertionError, match="pending"):
        gather.bind([], [(0, 4)])
    gather.wait_bucket(0)
    gather.wait_bucket(0)  # not pending: no-op
    assert gather.waited == [0]


def test_wrapped_model_state_dict_and_load_wait() -> None:
    model = _model()
    gather = ParamGather(model, list(model.parameters()))
    gather.bind([(0, 4), (4, 6), (6, 10), (10, 12)], [(0, 12)])
    log: list[int] = []
    gather.launch(0, FakeWork(log, 0), torch.zeros(1))
    state = model.state_dict()
    assert log == [0] and gather.pending == 0
    gather.launch(0, FakeWork(log, 0), torch.zeros(1))
    model.load_state_dict(state)
    assert log == [0, 0] and gather.pending == 0


class ReadsChildWeight(torch.nn.Module):
    """As torch's MultiheadAttention: reads ``self.out.weight`` without calling ``self.out``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2, 2))
        self.out = torch.nn.Linear(2, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w @ self.out.weight


def test_owner_read_without_its_forward_is_waited_by_its_nearest_fired_ancestor() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(ReadsChildWeight(), torch.nn.Linear(2, 2))
    model[1].unused = torch.nn.Linear(2, 2)  # never called: waited by its parent
    params = [model[0].w, model[0].out.weight, model[1].weight, model[1].bias, model[1].unused.weight]
    gather = ParamGather(model, params)
    gather.bind([(0, 4), (4, 8), (8, 12), (12, 14), (14, 18)], [(0, 4), (4, 8), (8, 14), (14, 18)])
    model(torch.ones(1, 2))  # the recording forward: model[0].out's pre-hook never fires
    log: list[int] = []
    for k in launch_order(4):
        gather.launch(k, FakeWork(log, k), torch.zeros(1))
    seen = []
    model[0].register_forward_pre_hook(lambda m, a: seen.append(gather.pending_buckets()))
    model(torch.ones(1, 2))
    assert seen == [[2, 3]]  # bucket 1 (out.weight) landed with bucket 0 before model[0] ran
    assert log == [0, 1, 2, 3]


def test_settle_waits_falls_back_to_the_root() -> None:
    root = torch.nn.Module()
    root.a = torch.nn.Module()
    root.a.b = torch.nn.Linear(1, 1)
    hooked = [root, root.a, root.a.b]
    owned = [[], [], [0, 1]]
    assert settle_waits(hooked, owned, {0, 2}) == [[], [], [0, 1]]  # fired: its own
    assert settle_waits(hooked, owned, {0, 1}) == [[], [0, 1], []]  # the nearest fired ancestor
    assert settle_waits(hooked, owned, set()) == [[0, 1], [], []]  # no forward ran: the root


def test_a_launch_before_any_forward_does_not_settle_the_waits() -> None:
    model = _model()
    gather = ParamGather(model, list(model.parameters()))
    gather.bind([(6, 10), (10, 12), (0, 4), (4, 6)], [(0, 6), (6, 12)])
    log: list[int] = []
    for k in launch_order(2):  # a checkpoint load before the first forward (it would land them itself)
        gather.launch(k, FakeWork(log, k), torch.zeros(1))
    model(torch.ones(1, 2))  # the recording forward: the root's pre-hook lands everything first
    assert log == [1, 0] and gather.phase is GatherPhase.IDLE
    for k in launch_order(2):  # the first step after a recorded forward settles: per-module waits
        gather.launch(k, FakeWork(log, k), torch.zeros(1))
    seen = []
    model[2].register_forward_pre_hook(lambda m, a: seen.append(gather.pending_buckets()))
    model[0].register_forward_pre_hook(lambda m, a: seen.append(gather.pending_buckets()))
    model(torch.ones(1, 2))
    assert seen == [[0], []]  # model[0] waited only for its own bucket, not the root for both
