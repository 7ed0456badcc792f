"""The pipeline formulas of zero/pipeline_memory.py: per-rank model-state bytes of one stage (at rest and during a
held step) and per-step traffic, held and per micro-batch ([Note: step-scoped hold] in zero/hold.py). Pure: no
processes."""

from __future__ import annotations

import pytest

from shardspeed.zero.hold import holds_step
from shardspeed.zero.memory import model_state_bytes
from shardspeed.zero.pipeline_memory import pipeline_model_state_bytes, pipeline_step_traffic

PSI, N, M = 1_200, 4, 8


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_at_rest_is_the_zero_table_on_the_stage(stage: int) -> None:
    got = pipeline_model_state_bytes(PSI, N, stage, precision="fp32")
    assert got.at_rest == model_state_bytes(PSI, N, stage, precision="fp32", accounting="shardspeed")


def test_fp32_adam_figures_per_stage() -> None:
    """16Ψ at stage 0; stage 3 at rest 16Ψ/N, plus the gathered stage (4Ψ) and its fp32 held gradients (4Ψ) during
    the step; stage 2 holds a full fp32 gradient buffer during the step (stage-1 gradient memory)."""
    rows = {s: pipeline_model_state_bytes(PSI, N, s, precision="fp32") for s in range(4)}
    assert rows[0].at_rest.total() == 16 * PSI and rows[0].during_step() == 16 * PSI
    assert rows[1].at_rest.total() == 8 * PSI + 8 * PSI // N == rows[1].during_step()
    assert rows[2].at_rest.total() == 4 * PSI + 12 * PSI // N
    assert rows[2].during_step() == rows[1].during_step() + 4 * PSI // N  # held: stage 1 gradients + the shard
    assert rows[3].at_rest.total() == 16 * PSI // N
    assert (rows[3].held_grads, rows[3].gathered_params) == (4 * PSI, 4 * PSI)
    assert rows[3].during_step() == 16 * PSI // N + 8 * PSI


def test_mixed_precision_holds_fp32_gradients_and_gathers_bf16_parameters() -> None:
    got = pipeline_model_state_bytes(PSI, N, 3, precision="mixed")
    assert (got.held_grads, got.gathered_params) == (4 * PSI, 2 * PSI)
    bf16 = pipeline_model_state_bytes(PSI, N, 3, precision="bf16")  # bf16 master weights: bf16 held gradients
    assert (bf16.held_grads, bf16.gathered_params) == (2 * PSI, 2 * PSI)


@pytest.mark.parametrize("stage", [2, 3])
def test_per_micro_batch_mode_adds_nothing_that_lasts(stage: int) -> None:
    got = pipeline_model_state_bytes(PSI, N, stage, precision="fp32", hold=False)
    assert got.during_step() == got.at_rest.total()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_held_step_moves_two_psi_like_one_data_parallel_step(stage: int) -> None:
    assert pipeline_step_traffic(PSI, N, stage, hold=True, micro_batches=M) == 2 * PSI * (N - 1) / N


def test_per_micro_batch_traffic_is_m_times_the_gradient_share() -> None:
    share = PSI * (N - 1) / N
    assert pipeline_step_traffic(PSI, N, 0, hold=False, micro_batches=M) == 2 * M * share
    assert pipeline_step_traffic(PSI, N, 1, hold=False, micro_batches=M) == (M + 1) * share
    assert pipeline_step_traffic(PSI, N, 2, hold=False, micro_batches=M) == (M + 1) * share
    assert pipeline_step_traffic(PSI, N, 3, hold=False, micro_batches=M) == 3 * M * share  # gathers per use


def test_one_data_rank_moves_nothing() -> None:
    assert all(pipeline_step_traffic(PSI, 1, s, hold=h, micro_batches=M) == 0 for s in range(4) for h in (True, False))


@pytest.mark.parametrize(
    ("args", "culprit"),
    [((PSI, N, 4, True, M), "zero_stage=4"), ((PSI, 0, 1, True, M), "dp=0"), ((PSI, N, 1, True, 0), "micro_batches=0")],
)
def test_bad_arguments_are_named(args: tuple, culprit: str) -> None:
    with pytest.raises(ValueError, match=culprit):
        pipeline_step_traffic(*args)


def test_hold_mode_refuses_tied_weights_per_micro_batch() -> None:
    assert holds_step("step", ["embed"]) and not holds_step("micro_batch")
    with pytest.raises(ValueError, match=r"zero_hold='micro_batch'.*embed"):
        holds_step("micro_batch", ["embed"])
    with pytest.raises(ValueError, match="'per_step' is not one of"):
        holds_step("per_step")
