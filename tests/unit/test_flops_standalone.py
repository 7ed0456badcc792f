"""DeepSpeed's standalone API (``FlopsProfiler``, ``get_model_profile``) when things go wrong: a raised call
leaves no counting state behind, a restart counts again, ``reset_profile`` only zeroes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.modules.module as module_globals
import torch.utils.checkpoint as checkpoint
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from shardspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile


class Flaky(nn.Module):
    """Raises on its second call (the profiled one, after one warm-up)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("boom in the profiled call")
        return self.lin(x)


def _no_counting_state_left() -> None:
    assert _get_current_dispatch_mode() is None
    assert checkpoint._enable_checkpoint_early_stop is not False
    assert not module_globals._global_forward_pre_hooks and not module_globals._global_forward_hooks


def test_a_raised_profiled_call_leaves_no_counting_state() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        get_model_profile(Flaky(), input_shape=(2, 4), print_profile=False)
    _no_counting_state_left()
    model = Flaky()
    model.calls = 1
    with pytest.raises(RuntimeError, match="boom"), FlopsProfiler(model):
        model(torch.ones(2, 4))
    _no_counting_state_left()


def test_a_raised_forward_does_not_stop_later_counting() -> None:
    model = nn.Linear(8, 8)
    prof = FlopsProfiler(model)
    prof.start_profile()
    with pytest.raises(RuntimeError):
        model(torch.ones(2, 3))  # wrong width
    model(torch.ones(2, 8))
    assert prof.get_total_flops() == 2 * 2 * 8 * 8
    prof.end_profile()
    prof.start_profile()
    model(torch.ones(2, 8))
    assert prof.get_total_flops() == 2 * 2 * 8 * 8
    prof.end_profile()


def test_reset_profile_zeroes_without_restarting() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.ones(2, 16))
    assert prof.get_total_duration() > 0 and prof._session._stats[id(model)].fwd_latency > 0  # root timed too
    prof.reset_profile()  # running: from zero, still counting
    assert prof.get_total_flops() == 0
    model(torch.ones(2, 16))
    assert prof.get_total_flops() == 2 * 2 * 2 * 16 * 16
    prof.stop_profile()
    prof.reset_profile()  # stopped: zeroed, and nothing is profiled until start_profile
    _no_counting_state_left()
    model(torch.ones(2, 16))
    assert prof.get_total_flops() == 0
    prof.end_profile()


@pytest.mark.parametrize("kind", ["mha", "encoder"])
def test_fused_fast_paths_count_as_the_unfused_path(kind: str) -> None:
    """Eval + no_grad sends MultiheadAttention / TransformerEncoderLayer down torch's fused ops ([Note: the fused
    fast paths]); the figure is the same as with grad enabled."""
    torch.manual_seed(0)
    if kind == "mha":
        module: nn.Module = nn.MultiheadAttention(32, 4, batch_first=True)
    else:
        module = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    x = torch.randn(2, 10, 32)
    args = [x, x, x] if kind == "mha" else [x]
    with_grad = get_model_profile(module, args=args, print_profile=False, as_string=False)[0]
    with torch.no_grad():
        fused = get_model_profile(module, args=args, print_profile=False, as_string=False)[0]
    b, s, e = 2, 10, 32
    attention = 4 * 2 * b * s * e * e + 4 * b * s * s * e
    assert with_grad == attention + (4 * b * s * e * 64 if kind == "encoder" else 0)
    assert fused == with_grad
