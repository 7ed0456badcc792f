"""The profile printout (profiling/summary.py, units.py): DeepSpeed's number formats and labelled lines."""

from __future__ import annotations

from torch import nn

from shardspeed.profiling.session import ModuleStats, PhaseTotals, WindowFigures
from shardspeed.profiling.summary import EngineContext, render_profile
from shardspeed.profiling.units import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

VALUES = [0, 0.5, 0.0004, 3, 1234, 120576, 16777216, 2.5e9, 3.3e12, 1e15]


def test_number_formats_are_deepspeeds() -> None:
    """Expected strings printed by DeepSpeed 0.19.8's own functions for the same values."""
    assert [number_to_string(v) for v in VALUES] == [
        "0 ", "500 m", "400 u", "3 ", "1.23 K", "120.58 K", "16.78 M", "2.5 G", "3.3 T", "1000 T",
    ]  # fmt: skip
    assert [params_to_string(v) for v in VALUES] == [
        "0", "500 m", "400 u", "3", "1.23 K", "120.58 K", "16.78 M", "2.5 B", "3.3 T", "1000 T",
    ]  # fmt: skip
    assert macs_to_string(16777216) == "16.78 MMACs" and macs_to_string(0) == "0 MACs"
    assert duration_to_string(0.0004) == "400 us" and duration_to_string(0.5) == "500 ms"
    assert flops_to_string(3.3e12) == "3.3 TFLOPS"


def _figures() -> WindowFigures:
    root = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    stats = [
        ModuleStats("", root, 0, 40, fwd_flops=640, bwd_flops=1280, fwd_latency=0.002),
        ModuleStats("0", root[0], 1, 40, fwd_flops=640, bwd_flops=1280, fwd_latency=0.001, bwd_latency=0.003),
        ModuleStats("1", root[1], 1, 0, fwd_latency=0.0005),
    ]
    phases = {
        "forward": PhaseTotals(640, 0.002, 1),
        "backward": PhaseTotals(1280, 0.004, 1),
        "step": PhaseTotals(0, 0.001, 1),
    }
    return WindowFigures(stats, phases, recompute_flops=0, params=40, wall_seconds=0.008)


def test_engine_summary_lines() -> None:
    context = EngineContext(
        world_size=4, dp_size=2, mp_size=2, micro_batch_size=3, samples_per_step=12, recompute_fwd_factor=1.0,
        model_params=70, model_fwd_flops=1280, model_flops_per_sample=320.0, peak_flops=1e9,
        peak_source="measured: probe", mfu=0.25,
    )  # fmt: skip
    lines = render_profile(_figures(), 2, module_depth=-1, top_modules=1, detailed=True, engine=context)
    text = "\n".join(lines)
    line = "{:<70}  {:<8}".format
    for expected in (
        "Profile Summary at step 2:",
        line("world size: ", 4),
        line("data parallel size: ", 2),
        line("model parallel size: ", 2),
        line("batch size per GPU: ", 3),
        line("params per GPU: ", "40"),
        line("params of model (sum over tensor/pipe ranks): ", "70"),
        line("fwd MACs per GPU: ", "320 MACs"),
        line("fwd flops per GPU: ", "640 "),
        line("fwd flops of model (sum over tensor/pipe ranks): ", "1.28 K"),
        line("fwd latency: ", "2 ms"),
        line("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", "320 KFLOPS"),
        line("bwd latency: ", "4 ms"),
        line("bwd FLOPS per GPU = 3 * fwd flops per GPU / bwd latency: ", "480 KFLOPS"),  # recompute_fwd_factor 1
        line("fwd+bwd FLOPS per GPU = 4 * fwd flops per GPU / (fwd+bwd latency): ", "426.67 KFLOPS"),
        line("step latency: ", "1 ms"),
        line("iter latency: ", "8 ms"),
        line("samples/second: ", 1500.0),
        line("MFU = model flops per sample * samples/second / (world size * peak): ", "25.00%"),
        "depth 0:",
        "    params      - {'Sequential': '40'}",
        "  (0): Linear(40 = 100% Params, 320 MACs = 100% MACs, 1 ms = 50% latency, 640 KFLOPS, 1.28 Kbwd flops, "
        "3 ms bwd latency, in_features=4, out_features=8, bias=True)",
    ):
        assert expected in lines or expected in text, expected


def test_without_detailed_there_is_no_tree() -> None:
    text = "\n".join(render_profile(_figures(), 1, detailed=False))
    assert "Detailed Profile per GPU" not in text and "Aggregated Profile per GPU" in text
    assert "{:<70}  {:<8}".format("params of model = params per GPU * mp_size: ", "40") in text
