"""cpu_adamw_step and stream_step against torch's optimizers and an independent float64 Adam."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from shardspeed.offload.aio_config import AioSettings
from shardspeed.offload.cpu_adam import cpu_adamw_step, has_fused_cpu_adam
from shardspeed.offload.stream import STREAM_STATES, init_stream_state, state_key, stream_step
from shardspeed.offload.swapper import TensorSwapper

HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
NUMEL = 10_007  # not a multiple of the chunk size: the last chunk is short
STEPS = 5


def _gradients(steps: int, numel: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(numel, generator=generator) for _ in range(steps)]


def _start() -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))


def _torch_run(adam_w_mode: bool, impl: str, start: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """Run torch.optim.AdamW (decoupled) or Adam (L2) with ``impl`` in {"fused", "foreach", "for-loop"}."""
    param = torch.nn.Parameter(start.clone())
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[impl]
    optimizer_class = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    optimizer = optimizer_class([param], **HYPER, **flags)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    return param.detach()


def _ours(adam_w_mode: bool, kernel: str, start: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    param, exp_avg, exp_avg_sq = start.clone(), torch.zeros(NUMEL), torch.zeros(NUMEL)
    for step, grad in enumerate(grads, start=1):
        cpu_adamw_step(param, grad.clone(), exp_avg, exp_avg_sq, step=step, adam_w_mode=adam_w_mode,
                       chunk_numel=1000, kernel=kernel, **HYPER)  # fmt: skip
    return param


def _float64_adam(adam_w_mode: bool, start: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """Adam written out from its definition (Kingma & Ba; Loshchilov & Hutter for decoupled decay), in float64."""
    lr, (beta1, beta2), eps, decay = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]
    param = start.double()
    m = torch.zeros_like(param)
    v = torch.zeros_like(param)
    for step, grad32 in enumerate(grads, start=1):
        grad = grad32.double()
        if adam_w_mode:
            param = param - lr * decay * param
        else:
            grad = grad + decay * param
        m = beta1 * m + (1 - beta1) * grad
        v = beta2 * v + (1 - beta2) * grad * grad
        m_hat = m / (1 - beta1**step)
        v_hat = v / (1 - beta2**step)
        param = param - lr * m_hat / (v_hat.sqrt() + eps)
    return param


@pytest.mark.skipif(not has_fused_cpu_adam(), reason="torch without the fused CPU Adam kernel")
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_kernel_is_bitwise_equal_to_torch_fused_optimizer(adam_w_mode: bool) -> None:
    start, grads = _start(), _gradients(STEPS, NUMEL)
    ours = _ours(adam_w_mode, "fused", start, grads)
    assert torch.equal(ours, _torch_run(adam_w_mode, "fused", start, grads))


@pytest.mark.parametrize("kernel", ["fused", "foreach"] if has_fused_cpu_adam() else ["foreach"])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_matches_torch_foreach_and_for_loop_optimizers(kernel: str, adam_w_mode: bool) -> None:
    start, grads = _start(), _gradients(STEPS, NUMEL)
    ours = _ours(adam_w_mode, kernel, start, grads)
    for impl in ("foreach", "for-loop"):
        reference = _torch_run(adam_w_mode, impl, start, grads)
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-7, msg=f"{kernel} vs torch {impl}")


@pytest.mark.parametrize("kernel", ["fused", "foreach"] if has_fused_cpu_adam() else ["foreach"])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_matches_float64_definition_including_bias_correction(kernel: str, adam_w_mode: bool) -> None:
    start, grads = _start(), _gradients(STEPS, NUMEL)
    expected = _float64_adam(adam_w_mode, start, grads)
    ours = _ours(adam_w_mode, kernel, start, grads).double()
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    # step 1, bias corrected, no decay: m̂ = g and v̂ = g², so each weight moves by lr·g/(|g| + eps)
    param = start.clone()
    cpu_adamw_step(param, grads[0], torch.zeros(NUMEL), torch.zeros(NUMEL), step=1, lr=0.5, kernel=kernel)
    moved = ((start - param) / 0.5).double()
    grad = grads[0].double()
    torch.testing.assert_close(moved, grad / (grad.abs() + 1e-8), rtol=0, atol=1e-6)


def test_list_inputs_and_argument_errors() -> None:
    params = [torch.ones(3), torch.ones(5)]
    grads = [torch.ones(3), torch.ones(5)]
    cpu_adamw_step(params, grads, [torch.zeros(3), torch.zeros(5)], [torch.zeros(3), torch.zeros(5)], step=1, lr=0.1)
    assert math.isclose(params[1][0].item(), 1 - 0.1, rel_tol=1e-6)
    one = torch.ones(4)
    with pytest.raises(ValueError, match="step = 0"):
        cpu_adamw_step(one, one, one, one, step=0, lr=0.1)
    with pytest.raises(ValueError, match=r"betas = \(0\.9, 1\.0\)"):
        cpu_adamw_step(one, one, one, one, step=1, lr=0.1, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"grads\[0\] is \(5,\)"):
        cpu_adamw_step(one, torch.ones(5), one, one, step=1, lr=0.1)
    with pytest.raises(ValueError, match="kernel = 'cuda'"):
        cpu_adamw_step(one, one, one, one, step=1, lr=0.1, kernel="cuda")  # type: ignore[arg-type]


class RecordingSwapper(TensorSwapper):
    """Records (operation, chunk name) for every swap call, to check the pipeline's order."""

    events: list[tuple[str, str]]

    def swap_in(self, name: str, out: torch.Tensor):  # type: ignore[no-untyped-def]
        self.events.append(("in", name.split("/")[0]))
        return super().swap_in(name, out)

    def swap_out(self, name: str, tensor: torch.Tensor):  # type: ignore[no-untyped-def]
        self.events.append(("out", name.split("/")[0]))
        return super().swap_out(name, tensor)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_stream_step_equals_in_memory_step_and_pipelines(tmp_path: Path, adam_w_mode: bool) -> None:
    sizes = [4000, 4000, 4000, 4000, 1234]
    names = [f"c{i}" for i in range(len(sizes))]
    start = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(2))
    settings = AioSettings(block_size=4096, queue_depth=4, thread_count=2)
    capacity = TensorSwapper.bytes_needed([4 * n for n in sizes for _ in STREAM_STATES], settings)
    param, exp_avg, exp_avg_sq = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    with RecordingSwapper(tmp_path, capacity, settings) as swapper:
        swapper.events = []
        for name, chunk in zip(names, start.split(sizes)):
            for handle in init_stream_state(swapper, name, chunk.clone()):
                handle.wait()
        for step, grad in enumerate(_gradients(3, sum(sizes)), start=1):
            swapper.events = []
            updated: dict[int, torch.Tensor] = {}

            def record_done(index: int, chunk: torch.Tensor, updated: dict[int, torch.Tensor] = updated) -> None:
                swapper.events.append(("done", names[index]))
                updated[index] = chunk.clone()

            stream_step(swapper, names, list(grad.split(sizes)), step=step, adam_w_mode=adam_w_mode,
                        on_chunk_done=record_done, **HYPER)  # fmt: skip
            cpu_adamw_step(param, grad, exp_avg, exp_avg_sq, step=step, adam_w_mode=adam_w_mode, **HYPER)
            assert torch.equal(torch.cat([updated[i] for i in range(len(names))]), param)
        last_step_events = list(swapper.events)
        for state, expected in zip(STREAM_STATES, (param, exp_avg, exp_avg_sq)):
            got = torch.cat([swapper.swap_in(state_key(n, state), torch.empty(s)).wait() for n, s in zip(names, sizes)])
            assert torch.equal(got, expected), state
    # read next ‖ step this ‖ write previous: chunk i+1's read is issued before chunk i is stepped and written
    compact: list[tuple[str, str]] = []
    for event in last_step_events:
        if not compact or compact[-1] != event:
            compact.append(event)
    assert compact[:6] == [("in", "c0"), ("in", "c1"), ("done", "c0"), ("out", "c0"), ("in", "c2"), ("done", "c1")]
    assert compact[-2:] == [("done", "c4"), ("out", "c4")]
