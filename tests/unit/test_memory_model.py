"""ZeRO model-state memory model and ``shardspeed estimate``.

Expectations are written out by hand from the ZeRO paper's formulas (arXiv 1910.02054, section 3.1 / Figure 1)
and DeepSpeed's documented estimator semantics, never computed by the code under test.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardspeed.zero.estimate import main as estimate_main
from shardspeed.zero.estimate import parse_param_count
from shardspeed.zero.memory import (
    ModelStateBytes,
    count_trainable_params,
    estimate_zero_memory,
    format_table,
    model_state_bytes,
)

PSI = 7_500_000_000  # the paper's 7.5B example
N = 64


# ---------------------------------------------------------------------------------------------------- paper table


@pytest.mark.parametrize(
    ("stage", "exact_bytes", "rounded_gb"),
    [
        (0, 120_000_000_000, 120.0),  # 16 * 7.5e9
        (1, 31_406_250_000, 31.4),  # 4 * 7.5e9 + 12 * 7.5e9 / 64
        (2, 16_640_625_000, 16.6),  # 2 * 7.5e9 + 14 * 7.5e9 / 64
        (3, 1_875_000_000, 1.9),  # 16 * 7.5e9 / 64
    ],
)
def test_paper_figures_for_7_5b_on_64_ranks(stage: int, exact_bytes: int, rounded_gb: float) -> None:
    states = model_state_bytes(PSI, N, stage)
    assert states.total() == exact_bytes
    assert round(states.total() / 1e9, 1) == rounded_gb
    assert states.cpu == 0


def test_paper_stage2_breakdown() -> None:
    # params replicated (2 B), grads and optimizer states sharded: 2*Ψ/N and 12*Ψ/N
    assert model_state_bytes(PSI, N, 2) == ModelStateBytes(
        params=15_000_000_000, grads=234_375_000, optimizer=1_406_250_000
    )


@pytest.mark.parametrize("world", [1, 2, 8, 16])
def test_fp32_formulas(world: int) -> None:
    psi = 1_600_000  # divisible by every world used
    expected = {0: 16 * psi, 1: 8 * psi + 8 * psi // world, 2: 4 * psi + 12 * psi // world, 3: 16 * psi // world}
    for stage, total in expected.items():
        assert model_state_bytes(psi, world, stage, precision="fp32").total() == total
        # fp32 training has no low-precision copy, so the engine allocates exactly the paper's figures
        assert model_state_bytes(psi, world, stage, precision="fp32", accounting="shardspeed").total() == total


@pytest.mark.parametrize("world", [1, 4, 64])
def test_shardspeed_accounting_keeps_fp32_gradients(world: int) -> None:
    psi = 6_400_000
    shard = psi // world
    assert model_state_bytes(psi, world, 0, accounting="shardspeed") == ModelStateBytes(2 * psi, 4 * psi, 12 * psi)
    assert model_state_bytes(psi, world, 1, accounting="shardspeed") == ModelStateBytes(2 * psi, 4 * psi, 12 * shard)
    assert model_state_bytes(psi, world, 2, accounting="shardspeed") == ModelStateBytes(2 * psi, 4 * shard, 12 * shard)
    assert model_state_bytes(psi, world, 3, accounting="shardspeed") == ModelStateBytes(
        2 * shard, 4 * shard, 12 * shard
    )


def test_custom_optimizer_state_bytes() -> None:
    # e.g. mixed-precision SGD with momentum: fp32 master 4 + momentum 4 = 8 B per parameter
    assert model_state_bytes(1000, 4, 0, optimizer_state_bytes_per_param=8).total() == (2 + 2 + 8) * 1000
    assert model_state_bytes(1000, 4, 1, optimizer_state_bytes_per_param=8).total() == 4 * 1000 + 8 * 250


def test_padding_counts_flat_buffers_padded_and_module_params_unpadded() -> None:
    # 10 parameters padded to 12 so that 4 ranks get 3 elements each
    assert model_state_bytes(10, 4, 0, padded_numel=12) == ModelStateBytes(params=20, grads=24, optimizer=144)
    assert model_state_bytes(10, 4, 2, padded_numel=12) == ModelStateBytes(params=20, grads=6, optimizer=36)
    assert model_state_bytes(10, 4, 3, padded_numel=12) == ModelStateBytes(params=6, grads=6, optimizer=36)
    # without an explicit padded count an uneven shard rounds up: ceil(10 / 4) = 3
    assert model_state_bytes(10, 4, 3) == ModelStateBytes(params=6, grads=6, optimizer=36)


# ---------------------------------------------------------------------------------------------------- offload


def test_offload_optimizer_moves_optimizer_and_gradient_partition_to_cpu() -> None:
    psi, world = 8_000_000, 8
    shard = psi // world
    # stage 1 still all-reduces full gradients on the GPU; the CPU holds states + an fp32 gradient partition
    assert model_state_bytes(psi, world, 1, offload_optimizer=True) == ModelStateBytes(
        params=2 * psi, grads=2 * psi, optimizer=0, cpu=16 * shard
    )
    # stage 2 (DeepSpeed ZeRO-Offload): only fp16 parameters stay on the GPU: 2Ψ per GPU, 16Ψ/N per GPU on CPU
    assert model_state_bytes(psi, world, 2, offload_optimizer=True) == ModelStateBytes(2 * psi, 0, 0, 16 * shard)
    # stage 3, optimizer only: the fp16 parameter shard stays
    assert model_state_bytes(psi, world, 3, offload_optimizer=True) == ModelStateBytes(2 * shard, 0, 0, 16 * shard)
    # stage 3, optimizer and parameters: nothing stays, 18Ψ/N on CPU (DeepSpeed's "18 * total_params")
    assert model_state_bytes(psi, world, 3, offload_optimizer=True, offload_param=True) == ModelStateBytes(
        0, 0, 0, 18 * shard
    )


def test_offload_rows_report_cpu_per_node() -> None:
    psi = 8_000_000
    rows = estimate_zero_memory(num_params=psi, num_gpus_per_node=4, num_nodes=2, print_table=False)
    variants = [(r["stage"], r["offload_optimizer"], r["offload_param"]) for r in rows]
    assert variants == [
        (0, False, False),
        (1, False, False),
        (1, True, False),
        (2, False, False),
        (2, True, False),
        (3, False, False),
        (3, True, False),
        (3, True, True),
    ]
    by_variant = dict(zip(variants, rows))
    both = by_variant[(3, True, True)]
    assert both["gpu_bytes"] == 0
    assert both["cpu_bytes_per_gpu"] == 18 * psi // 8
    assert both["cpu_bytes_per_node"] == 18 * psi // 2  # 4 of the 8 ranks live on each node
    stage2 = by_variant[(2, True, False)]
    assert (stage2["gpu_bytes"], stage2["cpu_bytes_per_node"]) == (2 * psi, 16 * psi // 2)
    assert all(r["cpu_bytes_per_node"] == 0 for r in rows if not r["offload_optimizer"])

    padded = estimate_zero_memory(
        num_params=psi, num_gpus_per_node=4, num_nodes=2, additional_buffer_factor=1.5, print_table=False
    )
    assert padded[-1]["cpu_bytes_per_node"] == 18 * psi // 2 * 3 // 2
    assert padded[-1]["gpu_bytes"] == 0  # the factor is CPU headroom only, as in DeepSpeed


# ---------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"stage": 4}, ["stage=4", "[0, 1, 2, 3]"]),
        ({"world": 0}, ["world=0", ">= 1"]),
        ({"precision": "mixd"}, ["precision='mixd'", '"mixed"']),
        ({"accounting": "papr"}, ["accounting='papr'", '"paper"']),
        ({"stage": 0, "offload_optimizer": True}, ["offload_optimizer", "stage 1, 2 or 3"]),
        ({"stage": 2, "offload_param": True}, ["offload_param", "stage 3"]),
        ({"padded_numel": 5}, ["padded_numel=5", ">= 10"]),
        ({"optimizer_state_bytes_per_param": -1}, ["optimizer_state_bytes_per_param=-1"]),
    ],
)
def test_bad_arguments_name_the_culprit(kwargs: dict[str, object], fragments: list[str]) -> None:
    arguments: dict[str, object] = {"num_params": 10, "world": 2, "stage": 1, **kwargs}
    with pytest.raises(ValueError) as caught:
        model_state_bytes(**arguments)  # type: ignore[arg-type]
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_estimate_needs_exactly_one_source_of_params() -> None:
    with pytest.raises(ValueError, match="exactly one of model= or num_params="):
        estimate_zero_memory(print_table=False)
    with pytest.raises(ValueError, match="exactly one"):
        estimate_zero_memory(nn.Linear(2, 2), num_params=6, print_table=False)


# ---------------------------------------------------------------------------------------------------- --params


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7.5e9", 7_500_000_000),
        ("7500000000", 7_500_000_000),
        ("7.5B", 7_500_000_000),
        ("7.5b", 7_500_000_000),
        ("350M", 350_000_000),
        ("1.3B", 1_300_000_000),  # exact, no float round-off
        ("1.3e9", 1_300_000_000),
        ("2K", 2_000),
        ("1T", 1_000_000_000_000),
        ("7_500_000_000", 7_500_000_000),
        (" 125M ", 125_000_000),
    ],
)
def test_parse_param_count_accepts(text: str, expected: int) -> None:
    assert parse_param_count(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "not a number"),
        ("abc", "not a number"),
        ("7.5X", "not a number"),
        ("B", "not a number"),
        ("1.5", "not a whole number"),
        ("1e-3", "not a whole number"),
        ("nan", "not a whole number"),
        ("inf", "not a whole number"),
        ("0", "must be positive"),
        ("-5M", "must be positive"),
    ],
)
def test_parse_param_count_rejects(text: str, reason: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_param_count(text)
    message = str(caught.value)
    assert repr(text) in message and reason in message and "7.5B" in message


# ---------------------------------------------------------------------------------------------------- model counting


class _TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)  # 40
        self.hidden = nn.Linear(4, 4)  # 20
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: counted once
        self.frozen = nn.Linear(4, 4)  # 20, excluded
        self.frozen.requires_grad_(False)


def test_count_trainable_params_counts_tied_once_and_skips_frozen() -> None:
    assert count_trainable_params(_TiedModel()) == 60


def test_count_trainable_params_dedups_parameters_sharing_memory() -> None:
    storage = torch.zeros(3, 5)
    model = nn.Module()
    model.a = nn.Parameter(storage)
    model.b = nn.Parameter(storage)  # a different Parameter object over the same memory
    model.c = nn.Parameter(torch.zeros(7))
    assert count_trainable_params(model) == 15 + 7


def test_count_trainable_params_on_meta_device() -> None:
    # meta tensors all report address 0; they must still be counted separately
    model = nn.Sequential(nn.Linear(1000, 1000, device="meta"), nn.Linear(1000, 1000, device="meta"))
    assert count_trainable_params(model) == 2 * 1_001_000


def test_estimate_from_model() -> None:
    rows = estimate_zero_memory(_TiedModel(), num_gpus_per_node=2, print_table=False)
    assert rows[0]["num_params"] == 60
    assert rows[0]["gpu_bytes"] == 16 * 60


# ---------------------------------------------------------------------------------------------------- output / CLI


def _stage_totals(output: str) -> dict[int, str]:
    """The 'GB per GPU' cell of each stage's no-offload row of the printed table."""
    totals = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        if len(cells) == 7 and cells[0].isdigit() and cells[6] == "offload_optimizer=none, offload_param=none":
            totals[int(cells[0])] = cells[1]
    return totals


def test_estimate_prints_table_with_assumptions(capsys: pytest.CaptureFixture[str]) -> None:
    rows = estimate_zero_memory(num_params=PSI, num_gpus_per_node=64)
    printed = capsys.readouterr().out
    assert printed.strip() == format_table(rows)
    assert _stage_totals(printed) == {0: "120.0", 1: "31.4", 2: "16.6", 3: "1.9"}
    assert "2 B params + 2 B grads + 12 B optimizer states per parameter (paper accounting" in printed
    assert "GB = 1e9 bytes" in printed


def test_cli_prints_paper_figures_and_offload_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert estimate_main(["--params", "7.5e9", "--num_gpus", "64"]) == 0
    printed = capsys.readouterr().out
    assert _stage_totals(printed) == {0: "120.0", 1: "31.4", 2: "16.6", 3: "1.9"}
    offload_rows = [line for line in printed.splitlines() if "offload_optimizer=cpu" in line]
    assert len(offload_rows) == 4
    # stage 3 with both offloads: 18 B * 7.5e9 / 64 per GPU, 64 GPUs on the node -> 135.0 GB of CPU memory
    last = [cell.strip() for cell in offload_rows[-1].split("|")]
    assert last[0] == "3" and last[5] == "135.0" and last[6].endswith("offload_param=cpu")
    assert "64 data-parallel ranks" in printed


def test_cli_fp32_and_shardspeed_accounting(capsys: pytest.CaptureFixture[str]) -> None:
    assert estimate_main(["--params", "7.5B", "--num_gpus", "8", "--num_nodes", "8", "--precision", "fp32"]) == 0
    printed = capsys.readouterr().out
    # 16Ψ = 120.0; 8Ψ + 8Ψ/64 = 60.9375; 4Ψ + 12Ψ/64 = 31.40625; 16Ψ/64 = 1.875
    assert _stage_totals(printed) == {0: "120.0", 1: "60.9", 2: "31.4", 3: "1.9"}
    assert "4 B params + 4 B grads + 8 B optimizer states per parameter" in printed

    assert estimate_main(["--params", "7.5B", "--num_gpus", "64", "--accounting", "shardspeed"]) == 0
    printed = capsys.readouterr().out
    # 18Ψ = 135.0; 6Ψ + 12Ψ/64 = 46.40625; 2Ψ + 16Ψ/64 = 16.875; 18Ψ/64 = 2.109375
    assert _stage_totals(printed) == {0: "135.0", 1: "46.4", 2: "16.9", 3: "2.1"}
    assert "2 B params + 4 B grads + 12 B optimizer states per parameter (shardspeed accounting" in printed


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--params", "7.5X"], "'7.5X' is not a number"),
        (["--num_gpus", "8"], "--params"),
        (["--params", "1B", "--num_gpus", "0"], "must be >= 1"),
        (["--params", "1B", "--precision", "fp8"], "invalid choice: 'fp8'"),
        (["--params", "1B", "--additional_buffer_factor", "0.5"], "must be >= 1.0"),
    ],
)
def test_cli_rejects_bad_arguments(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert estimate_main(argv) == 2
    captured = capsys.readouterr()
    assert fragment in captured.err
    assert captured.out == ""


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert estimate_main(["--help"]) == 0
    assert "--num_gpus" in capsys.readouterr().out


def test_dispatch_through_launcher(capsys: pytest.CaptureFixture[str]) -> None:
    from shardspeed.launcher.cli import main as launcher_main

    assert launcher_main(["estimate", "--params", "7.5e9", "--num_gpus", "64"]) == 0
    assert _stage_totals(capsys.readouterr().out) == {0: "120.0", 1: "31.4", 2: "16.6", 3: "1.9"}
    assert launcher_main(["estimate", "--params", "lots"]) == 2
    assert "'lots' is not a number" in capsys.readouterr().err
    assert launcher_main(["help", "estimate"]) == 0
    assert "shardspeed estimate" in capsys.readouterr().out
