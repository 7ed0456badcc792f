"""Activation checkpointing on one process: exact gradients with dropout, RNG replay, argument handling, API."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from shardspeed import checkpointing
from shardspeed.checkpointing import CheckpointingContext
from shardspeed.config.activation import ActivationCheckpointingConfig

H = 12
MODES = ["non_reentrant", "reentrant"]


@pytest.fixture(autouse=True)
def _no_default_context() -> None:
    checkpointing.set_default_context(None)
    yield
    checkpointing.set_default_context(None)


def make_blocks(n: int = 4, p: float = 0.3) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(H, 3 * H), nn.GELU(), nn.Dropout(p), nn.Linear(3 * H, H)) for _ in range(n)
    )


def context(mode: str = "non_reentrant", **options: bool) -> CheckpointingContext:
    return CheckpointingContext(ActivationCheckpointingConfig(**options), use_reentrant=mode == "reentrant")


def train_pass(blocks: nn.ModuleList, x: torch.Tensor, ctx: CheckpointingContext | None, every: int = 1) -> dict:
    """One forward + backward from a fixed RNG state; returns output, every gradient and the next random draw."""
    torch.manual_seed(1234)
    blocks.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(x.requires_grad)
    if ctx is None:
        h = x
        for block in blocks:
            h = block(h)
    else:
        h = checkpointing.run_blocks(blocks, x, every=every, context=ctx)
    h.square().sum().backward()
    grads = [p.grad.clone() for p in blocks.parameters()]
    return {"out": h.detach(), "grads": grads, "x_grad": x.grad, "next_draw": torch.rand(3)}


def assert_same_pass(a: dict, b: dict) -> None:
    assert torch.equal(a["out"], b["out"])
    assert all(torch.equal(g, h) for g, h in zip(a["grads"], b["grads"], strict=True))
    assert (a["x_grad"] is None and b["x_grad"] is None) or torch.equal(a["x_grad"], b["x_grad"])
    assert torch.equal(a["next_draw"], b["next_draw"])  # the recompute did not advance the RNG stream


# ------------------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("options", [{}, {"cpu_checkpointing": True}, {"profile": True, "partition_activations": True}])
def test_gradients_identical_with_dropout(mode: str, options: dict) -> None:
    blocks, x = make_blocks(), torch.randn(5, H, requires_grad=True)
    plain = train_pass(blocks, x, None)
    assert_same_pass(plain, train_pass(blocks, x, context(mode, **options)))
    blocks.eval()  # dropout really is active in the training passes: without it the output changes
    assert not torch.equal(plain["out"], _plain_forward(blocks, x))


def _plain_forward(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        for block in blocks:
            x = block(x)
    return x


def test_the_exactness_check_can_fail_without_rng_replay() -> None:
    """Torch's checkpoint without RNG preservation draws new dropout masks in the recompute: gradients differ,
    so the equality asserted above is a real check."""
    blocks, x = make_blocks(), torch.randn(5, H, requires_grad=True)
    plain = train_pass(blocks, x, None)
    torch.manual_seed(1234)
    blocks.zero_grad(set_to_none=True)
    h = x
    for block in blocks:
        h = torch_checkpoint.checkpoint(block, h, use_reentrant=False, preserve_rng_state=False)
    h.square().sum().backward()
    assert torch.equal(h.detach(), plain["out"])
    assert not all(torch.equal(p.grad, g) for p, g in zip(blocks.parameters(), plain["grads"]))


@pytest.mark.parametrize("mode", MODES)
def test_tracker_fork_inside_a_region_is_replayed(mode: str) -> None:
    """Dropout drawn from the tensor-parallel stream inside a region gets the same mask in the recompute, and the
    stream ends where it would without checkpointing."""
    torch.manual_seed(0)
    linear = nn.Linear(H, H)
    x = torch.randn(6, H, requires_grad=True)

    def region(ctx: CheckpointingContext, h: torch.Tensor) -> torch.Tensor:
        with ctx.tracker.fork():
            h = nn.functional.dropout(linear(h), 0.5, training=True)
        return nn.functional.dropout(h, 0.5, training=True)

    results = []
    for checkpointed in (False, True):
        ctx = context(mode)
        ctx.model_parallel_manual_seed(7)
        linear.zero_grad(set_to_none=True)
        x.grad = None
        out = ctx.checkpoint(region, ctx, x) if checkpointed else region(ctx, x)
        out.sum().backward()
        with ctx.tracker.fork():
            after = torch.rand(4)
        results.append((out.detach(), linear.weight.grad.clone(), x.grad.clone(), after, torch.rand(4)))
    for plain, ckpt in zip(*results):
        assert torch.equal(plain, ckpt)


def test_retained_graph_recomputes_again() -> None:
    blocks, x = make_blocks(2), torch.randn(4, H)
    torch.manual_seed(3)
    h = checkpointing.run_blocks(blocks, x, context=context())
    h.sum().backward(retain_graph=True)
    once = [p.grad.clone() for p in blocks.parameters()]
    h.sum().backward()
    assert all(torch.equal(p.grad, 2 * g) for p, g in zip(blocks.parameters(), once))


# ------------------------------------------------------------------------------------------------ arguments


@pytest.mark.parametrize("mode", MODES)
def test_kwargs_non_tensor_args_and_inputs_without_grad(mode: str) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(H, H)
    x = torch.randn(4, H)  # requires no grad: parameters must still get theirs
    mask = torch.tensor([1, 0, 1, 1])  # an integer tensor
    bias = torch.randn(H, requires_grad=True)

    def region(h: torch.Tensor, scale: float, *, mask: torch.Tensor, bias: torch.Tensor, act: str) -> torch.Tensor:
        out = getattr(torch, act)(linear(h) * scale + bias)
        return nn.functional.dropout(out, 0.2, training=True) * mask[:, None]

    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(9)
        linear.zero_grad(set_to_none=True)
        bias.grad = None
        kwargs = {"mask": mask, "bias": bias, "act": "tanh"}
        out = context(mode).checkpoint(region, x, 0.5, **kwargs) if checkpointed else region(x, 0.5, **kwargs)
        out.sum().backward()
        grads.append((out.detach(), linear.weight.grad.clone(), bias.grad.clone()))
    for plain, ckpt in zip(*grads):
        assert torch.equal(plain, ckpt)
    assert linear.weight.grad.abs().sum() > 0


def test_tuple_outputs_with_non_tensors() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(H, H)
    x = torch.randn(3, H, requires_grad=True)

    def region(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
        y = linear(h)
        return y.relu(), y.argmax(dim=1), "done"

    y, idx, tag = context().checkpoint(region, x)
    assert tag == "done" and idx.dtype == torch.int64
    y.sum().backward()
    expected = (linear(x).detach() > 0).float().sum(dim=0)  # d/db of sum(relu(Wx+b))
    assert torch.equal(linear.bias.grad, expected)


def test_reentrant_outputs_must_be_tensors_or_tuples() -> None:
    with pytest.raises(TypeError, match="must return a tensor or a tuple, got dict"):
        context("reentrant").checkpoint(lambda h: {"h": h * 2}, torch.ones(2, requires_grad=True))


def test_no_grad_mode_runs_the_function_plainly() -> None:
    calls = []

    def region(h: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return h * 3

    with torch.no_grad():
        out = context().checkpoint(region, torch.ones(2, requires_grad=True))
    assert out.grad_fn is None and torch.equal(out, torch.full((2,), 3.0)) and len(calls) == 1


def test_in_place_change_of_an_input_after_the_forward_is_detected() -> None:
    linear = nn.Linear(H, H)
    x = torch.randn(2, H)
    out = context().checkpoint(linear, x)
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place after the region's forward"):
        out.sum().backward()


def test_checkpoint_requires_a_callable() -> None:
    with pytest.raises(TypeError, match=r"checkpoint\(function=...\): expected a callable, got Tensor"):
        checkpointing.checkpoint(torch.ones(1))


# ------------------------------------------------------------------------------------------------ blocks


def test_every_kth_block_is_recomputed_and_gradients_match() -> None:
    blocks, x = make_blocks(5), torch.randn(4, H, requires_grad=True)
    calls = [0] * len(blocks)
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    plain = train_pass(blocks, x, None)
    calls[:] = [0] * len(blocks)
    assert_same_pass(plain, train_pass(blocks, x, context(), every=2))
    assert calls == [2, 1, 2, 1, 2]  # blocks 0, 2, 4 ran again in the recompute, hooks included


def test_checkpoint_sequential_keeps_names_and_gradients() -> None:
    blocks = make_blocks(3)
    model = nn.Sequential(*blocks)
    wrapped = checkpointing.checkpoint_sequential(model, every=1, context=context())
    assert list(wrapped.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(wrapped, model))
    x = torch.randn(4, H)
    outs, grads = [], []
    for net in (model, wrapped):
        torch.manual_seed(5)
        net.zero_grad(set_to_none=True)
        out = net(x)
        out.sum().backward()
        outs.append(out.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    assert torch.equal(*outs)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_every_must_be_a_positive_integer(every: object) -> None:
    with pytest.raises(ValueError, match=r"every=.*expected a positive integer"):
        checkpointing.run_blocks(make_blocks(1), torch.ones(1, H), every=every)


# ------------------------------------------------------------------------------------------------ module API


def test_module_level_api_and_default_context() -> None:
    assert not checkpointing.is_configured()
    tracker = checkpointing.get_cuda_rng_tracker()  # made on first use, unconfigured
    assert tracker is checkpointing.get_rng_tracker() and not checkpointing.is_configured()
    checkpointing.model_parallel_cuda_manual_seed(11)
    ctx = checkpointing.configure(None, {"activation_checkpointing": {"cpu_checkpointing": True}}, profile=True)
    assert checkpointing.is_configured() and checkpointing.default_context() is ctx
    assert ctx.tracker is tracker and "model-parallel-rng" in tracker.get_states()  # seeds survive configure
    blocks, x = make_blocks(2), torch.randn(3, H)
    h = x
    for block in blocks:
        h = checkpointing.checkpoint(block, h)
    h.sum().backward()
    assert ctx.stats is not None and (ctx.stats.forward_calls, ctx.stats.recompute_calls) == (2, 2)
    assert ctx.stats.stored_bytes == 2 * x.numel() * 4 and "2 forwards" in ctx.stats.summary()
    checkpointing.reset()  # DeepSpeed's reset(): buffers only; the configuration stays
    assert checkpointing.is_configured() and checkpointing.default_context().config.cpu_checkpointing
    checkpointing.set_default_context(None)
    assert not checkpointing.is_configured()


class MegatronMpu:
    """A Megatron-style mpu for a single process (tensor-parallel world of one)."""

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self) -> None:
        return None


def test_configure_takes_an_mpu_or_a_topology() -> None:
    from shardspeed.topology import Topology

    assert checkpointing.configure(MegatronMpu()).tensor_axis.size == 1
    topology = Topology.build()
    assert checkpointing.configure(topology=topology).tensor_axis is topology.tensor
    assert checkpointing.configure(topology).tensor_axis is topology.tensor
    with pytest.raises(TypeError, match="object has none of get_tensor_model_parallel_world_size"):
        checkpointing.configure(object())
    with pytest.raises(ValueError, match=r"either mpu_ .* or topology="):
        checkpointing.configure(MegatronMpu(), topology=topology)
    with pytest.raises(TypeError, match="use_reentrant='no': expected True or False"):
        checkpointing.configure(use_reentrant="no")
