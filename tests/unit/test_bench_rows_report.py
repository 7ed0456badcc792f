"""bench_engine's pure pieces for issue #16: targets, exposed communication, before/after pairs, the CUDA world
plan, the DeepSpeed process split, the comm-bound MLP, and the launchers' shared environment.

Expected figures are worked out by hand in the comments; nothing here starts a process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_engine import models_of, parse_args, plan_world, requested_rows, split_rows
from bench_exposed import by_category, category, median_over_rounds, per_step_ms, summarize
from bench_models import MODEL_SIZES, build_template_model, make_setup
from bench_report import before_after_pairs, exposed_lines, format_cross_set, format_report, target_verdict
from bench_rows import (
    BEFORE_ADAM,
    BEFORE_EXTRA,
    BEFORE_ZERO,
    DEEPSPEED_ROWS,
    PEER_ADAM_ENV,
    ROWS,
    Row,
    default_rows,
    engine_config,
    peer_adamw_params,
    resolve_rows,
    timing_order,
)
from launch_util import REPO_SRC, child_env, free_port

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


# --- targets ---------------------------------------------------------------------------------------------------
def test_target_verdict_compares_the_median_with_the_bound() -> None:
    assert target_verdict(0.95, 0.95) == "≤ 0.95 met"  # at the bound counts as met
    assert target_verdict(0.951, 0.95) == "≤ 0.95 NOT met"
    assert target_verdict(0.70, 0.80) == "≤ 0.80 met"
    assert target_verdict(1.2, None) == "-"


def test_rows_carry_the_issue_targets_and_peers() -> None:
    expected = {
        "stage0": ("ddp", 1.00),
        "stage1": ("zero_redundancy", 0.95),
        "stage2": ("ddp", 1.05),
        "stage3": ("fsdp2", 0.80),
        "stage3_nopersist": ("fsdp2", 0.80),
    }
    for name, (peer, target) in expected.items():
        for row in (ROWS[name], ROWS[name + "_before"]):
            assert (row.peer, row.target) == (peer, target), row.name
    for stage, name in enumerate(DEEPSPEED_ROWS):
        assert (ROWS[name].peer, ROWS[name].target) == (expected[f"stage{stage}"][0], expected[f"stage{stage}"][1])
    assert all(ROWS[peer].target is None for peer in ("ddp", "zero_redundancy", "fsdp2"))


def test_before_rows_turn_off_the_overlap_and_pin_native_collectives() -> None:
    setup = make_setup(MODEL_SIZES["small"], rank=0)
    config = engine_config(setup, 1, BEFORE_ZERO, BEFORE_EXTRA, BEFORE_ADAM)
    assert config["zero_optimization"] == {
        "stage": 1,
        "overlap_param_gather": False,
        "reduce_bucket_size": 500_000_000,  # DeepSpeed's default, the buckets before the knee
        "allgather_bucket_size": 500_000_000,
    }
    assert config["communication"] == {"collectives": "native"}
    assert config["optimizer"]["params"]["fused"] is False  # torch's per-tensor AdamW loop, as before
    after = engine_config(setup, 1)
    assert "communication" not in after and "fused" not in after["optimizer"]["params"]  # the config's defaults


def test_peer_adam_kernel_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PEER_ADAM_ENV, raising=False)
    assert "fused" not in peer_adamw_params()  # what torch.optim.AdamW(params) gives a torch user
    monkeypatch.setenv(PEER_ADAM_ENV, "fused")
    assert peer_adamw_params()["fused"] is True
    monkeypatch.setenv(PEER_ADAM_ENV, "fast")
    with pytest.raises(ValueError, match="SHARDSPEED_BENCH_PEER_ADAM='fast'"):
        peer_adamw_params()


def test_default_rows_per_model() -> None:
    mlp, small = default_rows("mlp"), default_rows("small")
    assert {"stage0", "stage1", "stage2", "stage3", "ddp", "zero_redundancy", "fsdp2"} <= set(mlp)
    assert {f"stage{s}_before" for s in range(4)} <= set(mlp)
    # the MLP's weights are above the persistence threshold: its stage3 row partitions them already
    assert not [name for name in mlp if "nopersist" in name]
    assert {"stage3_nopersist", "stage3_nopersist_before"} <= set(small)
    assert not set(DEEPSPEED_ROWS) & set(small)


def test_timing_order_puts_each_peer_amid_its_rows() -> None:
    names = [row.name for row in timing_order(resolve_rows(list(default_rows("mlp"))))]
    # ddp's rows stage0, stage2, stage0_before, stage2_before: two before it, two after; then the other groups
    assert names == [
        "stage0",
        "stage2",
        "ddp",
        "stage0_before",
        "stage2_before",
        "stage1",
        "zero_redundancy",
        "stage1_before",
        "stage3",
        "fsdp2",
        "stage3_before",
    ]
    # a DeepSpeed set: the peers come from resolve_rows, each amid its rows
    ds = [row.name for row in timing_order(resolve_rows(list(DEEPSPEED_ROWS)))]
    assert ds == ["deepspeed0", "ddp", "deepspeed2", "deepspeed1", "zero_redundancy", "deepspeed3", "fsdp2"]


def test_timing_order_places_every_row_once_even_for_a_chain_of_peers() -> None:
    def row(name: str, peer: str | None) -> Row:
        return Row(name, name, lambda setup: None, peer)  # type: ignore[arg-type,return-value]

    chain = [row("a", "b"), row("b", "c"), row("c", None), row("d", None)]
    names = [r.name for r in timing_order(chain)]
    assert sorted(names) == ["a", "b", "c", "d"] and len(names) == 4
    assert names.index("a") < names.index("b")  # a next to its peer b


# --- exposed communication ------------------------------------------------------------------------------------
def test_category_by_tag() -> None:
    assert category("all_reduce:grads") == "grads"
    assert category("reduce_scatter:grads") == "grads"
    assert category("all_gather:params") == "params"
    assert category("broadcast:params") == "params"  # whatever op B's algorithm uses, the tag decides
    assert category("all_reduce(max):step_checks") == "other"
    assert category("all_gather:unit_ids") == "other"
    assert category("barrier") == "other"  # untagged


def test_per_step_ms_is_the_mean_over_ranks() -> None:
    ranks = [{"all_reduce:grads": 0.2, "all_gather:params": 0.1}, {"all_reduce:grads": 0.4}]
    # grads: (0.2 + 0.4) / 2 ranks = 0.3 s over 10 steps = 30 ms/step; params: (0.1 + 0) / 2 / 10 = 5 ms/step
    assert per_step_ms(ranks, steps=10) == pytest.approx({"all_gather:params": 5.0, "all_reduce:grads": 30.0})
    with pytest.raises(ValueError, match="steps must be at least 1"):
        per_step_ms(ranks, steps=0)
    with pytest.raises(ValueError, match="seconds_by_rank is empty"):
        per_step_ms([], steps=1)


def test_by_category_and_median_over_rounds() -> None:
    one = {"all_reduce:grads": 30.0, "all_gather:params": 5.0, "all_reduce(max):step_checks": 1.0}
    assert by_category(one) == {"total": 36.0, "grads": 30.0, "params": 5.0, "other": 1.0}
    rounds = [{"a:grads": 1.0}, {"a:grads": 3.0, "b:params": 2.0}, {"a:grads": 2.0}]
    # a:grads median of 1, 3, 2 = 2; b:params median of 0, 2, 0 = 0 (missing counts 0)
    assert median_over_rounds(rounds) == {"a:grads": 2.0, "b:params": 0.0}
    groups, keys = summarize(rounds)
    # totals per round 1, 5, 2 -> median 2; params per round 0, 2, 0 -> 0
    assert groups == {"total": 2.0, "grads": 2.0, "params": 0.0, "other": 0.0}
    assert keys == {"a:grads": 2.0, "b:params": 0.0}
    with pytest.raises(ValueError, match="rounds is empty"):
        median_over_rounds([])


def _timing_with_before_after() -> dict:
    rows = [
        {"name": "stage1", "peer": "zero_redundancy", "description": "a", "target": 0.95},
        {"name": "zero_redundancy", "peer": None, "description": "b", "target": None},
        {"name": "stage1_before", "peer": "zero_redundancy", "description": "c", "target": 0.95},
    ]
    return {
        "rows": rows,
        "step_ms": {"stage1": [90.0, 100.0, 95.0], "zero_redundancy": [100.0] * 3, "stage1_before": [120.0] * 3},
        "blocked_ms": {
            "stage1": [{"reduce_scatter:grads": 10.0, "all_gather:params": 1.0}] * 3,
            "stage1_before": [{"reduce_scatter:grads": 12.0, "all_gather:params": 20.0}] * 3,
        },
        "final_loss": {"stage1": 1.0, "zero_redundancy": 1.0, "stage1_before": 1.0},
    }


def test_before_after_pairs_need_both_rows() -> None:
    assert before_after_pairs(["stage1", "stage1_before", "stage2"], ["stage1", "stage1_before"]) == [
        ("stage1_before", "stage1")
    ]
    assert before_after_pairs(["stage2"], ["stage2"]) == []


def test_report_shows_targets_exposed_comm_and_before_after() -> None:
    timing = _timing_with_before_after()
    report = format_report(timing, {})
    # stage1/zero_redundancy ratios 0.90, 1.00, 0.95: median 0.95 -> met; stage1_before 1.20 -> not met
    stage1 = next(line for line in report.splitlines() if line.startswith("stage1 "))
    assert "0.950×" in stage1 and "≤ 0.95 met" in stage1 and "11.0" in stage1  # exposed total 10 + 1
    before = next(line for line in report.splitlines() if line.startswith("stage1_before "))
    assert "1.200×" in before and "≤ 0.95 NOT met" in before and "32.0" in before
    lines = exposed_lines(timing)
    table = "\n".join(lines)
    assert "reduce_scatter:grads 10.00, all_gather:params 1.00" in table
    # after/before per round: 90/120, 100/120, 95/120 -> median 95/120 = 0.792
    assert "stage1 after/before: step time 0.792×" in table
    assert "exposed comm 32.00 -> 11.00 ms/step" in table


def test_cross_set_goes_through_the_common_peer() -> None:
    ours = {
        "step_ms": {"stage1": [90.0, 90.0], "zero_redundancy": [100.0, 100.0]},
        "final_loss": {"stage1": 1.0},
    }
    theirs = {
        "rows": [
            {"name": "deepspeed1", "peer": "zero_redundancy"},
            {"name": "zero_redundancy", "peer": None},
            {"name": "deepspeed3", "peer": "fsdp2"},  # no stage3 in the shardspeed set: skipped
        ],
        "step_ms": {"deepspeed1": [150.0, 150.0], "zero_redundancy": [120.0, 120.0], "deepspeed3": [1.0, 1.0]},
        "final_loss": {"deepspeed1": 1.00002, "deepspeed3": 2.0},
    }
    text = format_cross_set(ours, theirs)
    # ours 0.9, theirs 150/120 = 1.25: 0.9 / 1.25 = 0.72
    assert "stage1 / deepspeed1 = 0.900 / 1.250 = 0.720× (via zero_redundancy)" in text
    assert "|loss - deepspeed1 loss| = 2.0e-05" in text
    assert "deepspeed3" not in text


# --- launcher -------------------------------------------------------------------------------------------------
def test_plan_world_caps_cuda_ranks_at_the_gpu_count() -> None:
    assert plan_world(2, "cpu", 0) == (2, "world 2 (gloo, CPU)")
    assert plan_world(4, "cpu", 8)[0] == 4  # CPU ignores GPUs
    assert plan_world(2, "cuda", 4) == (2, "world 2 (NCCL, one rank per GPU)")
    ranks, note = plan_world(2, "cuda", 1)
    assert ranks == 1 and "--nproc 2 capped at the 1 visible GPU(s)" in note and "world-1 rows" in note
    ranks, note = plan_world(8, "cuda", 2)
    assert ranks == 2 and "capped at the 2 visible GPU(s)" in note and "world-1" not in note
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        plan_world(2, "cuda", 0)


def test_split_rows_sends_deepspeed_rows_to_their_python() -> None:
    rows = ["stage0", "ddp", "deepspeed0", "deepspeed3"]
    assert split_rows(rows, None) == (rows, [])
    assert split_rows(rows, "/venv/bin/python") == (["stage0", "ddp"], ["deepspeed0", "deepspeed3"])


def test_arguments() -> None:
    args = parse_args(["--model", "all", "--device", "cuda", "--deepspeed-python", "/x/python", "--skip-memory"])
    assert (args.model, args.device, args.deepspeed_python, args.skip_memory) == ("all", "cuda", "/x/python", True)
    assert models_of("all") == ["mlp", "small"] and models_of("medium") == ["medium"]
    assert parse_args([]).rounds >= 7  # the issue asks for at least 7 paired rounds by default
    with pytest.raises(SystemExit):
        parse_args(["--device", "tpu"])
    with pytest.raises(SystemExit):
        parse_args(["--nproc", "0"])
    plain = parse_args(["--model", "mlp"])
    assert requested_rows(plain, "mlp", deepspeed_available=True)[-4:] == list(DEEPSPEED_ROWS)
    assert not set(DEEPSPEED_ROWS) & set(requested_rows(plain, "mlp", deepspeed_available=False))
    picked = parse_args(["--rows", "stage1, deepspeed1"])
    assert requested_rows(picked, "mlp", deepspeed_available=False) == ["stage1", "deepspeed1"]


def test_comm_bound_mlp_is_the_issue_model() -> None:
    model, description = build_template_model(MODEL_SIZES["mlp"])
    # 6 x (1024 * 1024 weights + 1024 biases) = 6,297,600 parameters: the issue's "6.3M"
    assert sum(p.numel() for p in model.parameters()) == 6_297_600
    assert "MLP" in description
    setup = make_setup(MODEL_SIZES["mlp"], rank=1)
    assert tuple(setup.inputs.shape) == (32, 1024) and tuple(setup.targets.shape) == (32, 1024)
    assert setup.fresh_model()(setup.inputs, setup.targets).ndim == 0  # forward(x, target) is the MSE loss
    other = make_setup(MODEL_SIZES["mlp"], rank=0)
    assert not other.inputs.equal(setup.inputs)  # each rank its own batch


def test_child_env_puts_src_first_and_hides_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("SHARDSPEED_INJECT", "spec")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = child_env(paths=[BENCHMARKS])
    assert env["PYTHONPATH"].split(":") == [str(REPO_SRC), str(BENCHMARKS), "/elsewhere"]
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["OMP_NUM_THREADS"] == "3"
    forced = child_env(cpu_only=False, force_one_thread=True, unset=["SHARDSPEED_INJECT"], DS_ACCELERATOR="cpu")
    assert forced["OMP_NUM_THREADS"] == "1" and "SHARDSPEED_INJECT" not in forced
    assert forced["DS_ACCELERATOR"] == "cpu" and forced.get("CUDA_VISIBLE_DEVICES") != ""
    assert 0 < free_port() < 65536


def test_no_launcher_keeps_its_own_copy_of_the_helpers() -> None:
    """One free_port / child_env for every launcher."""
    for script in sorted(BENCHMARKS.glob("*.py")):
        if script.name == "launch_util.py":
            continue
        text = script.read_text()
        assert "def _free_port" not in text and "def _child_env() -> dict[str, str]:\n    env" not in text, script.name
