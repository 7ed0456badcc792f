"""The memory model under pipeline parallelism: one stage's model-state bytes per rank (at rest, and what the
step-scoped hold adds while a ``train_batch`` runs) and its per-step data-axis traffic. Pure arithmetic on top of
``memory.py``'s ZeRO table, applied to Ψ_stage ([Note: step-scoped hold] in zero/hold.py)."""

from __future__ import annotations

from dataclasses import dataclass

from shardspeed.zero.memory import STAGES, ModelStateBytes, _check_count, bytes_per_param, model_state_bytes

__all__ = ["PipelineStateBytes", "pipeline_model_state_bytes", "pipeline_step_traffic"]


@dataclass(frozen=True)
class PipelineStateBytes:
    """Model-state bytes one rank of a pipeline stage holds under ZeRO ([Note: step-scoped hold] in zero/hold.py):
    ``at_rest`` between steps (the ZeRO table on Ψ_stage), and what a held step adds while it runs."""

    at_rest: ModelStateBytes
    held_grads: int  # stage 2: the full held gradient buffer; stage 3: the per-unit held gradients
    gathered_params: int  # stage 3: the stage's units, gathered from their first use to the step's reduction

    def during_step(self) -> int:
        """Accelerator bytes at the end of a held step's last backward (before ``reduce_held``)."""
        return self.at_rest.total() + self.held_grads + self.gathered_params


def pipeline_model_state_bytes(
    stage_numel: int,
    dp: int,
    zero_stage: int,
    *,
    precision: str = "mixed",
    hold: bool = True,
    optimizer_state_bytes_per_param: int | None = None,
    offload_optimizer: bool = False,
) -> PipelineStateBytes:
    """Per-rank model-state bytes of one pipeline stage of ``stage_numel`` (padded) elements over ``dp`` data-parallel
    ranks, as shardspeed's engine allocates them (``accounting="shardspeed"``: gradients accumulate in the master
    dtype). At rest: ``model_state_bytes`` on Ψ_stage (stage 3 fp32 Adam: 16Ψ/N). During a held step
    (``hold``): stage 2 adds a full gradient buffer (stage-1 gradient memory), stage 3 a full held gradient and the
    gathered stage (fp32: 16Ψ/N + 4Ψ + 4Ψ); stages 0/1 hold in the buffer they have anyway. Per-micro-batch mode
    (``hold=False``) adds nothing that lasts (ZeRO-3's working set of gathered units is transient)."""
    at_rest = model_state_bytes(
        stage_numel,
        dp,
        zero_stage,
        precision=precision,
        accounting="shardspeed",
        optimizer_state_bytes_per_param=optimizer_state_bytes_per_param,
        offload_optimizer=offload_optimizer,
    )
    per = bytes_per_param(precision, "shardspeed", optimizer_state_bytes_per_param)
    held = per.grads * stage_numel if hold and zero_stage >= 2 else 0
    gathered = per.params * stage_numel if hold and zero_stage == 3 else 0
    return PipelineStateBytes(at_rest=at_rest, held_grads=held, gathered_params=gathered)


def pipeline_step_traffic(stage_numel: int, dp: int, zero_stage: int, hold: bool, micro_batches: int) -> float:
    """Elements each rank sends per pipeline step for gradients and parameters under a ring algorithm (the comms
    log's algorithmic figure; Ψ = ``stage_numel`` padded, N = ``dp``, m = ``micro_batches``, r = 1 held / m per
    micro-batch gradient reductions):
      stage 0: r all-reduces, 2Ψ(N−1)/N each;
      stage 1/2: r reduce-scatters + one all-gather of the updated parameters, Ψ(N−1)/N each;
      stage 3: r reduce-scatters + gathers: held, each unit once per step; per micro-batch, once per use (forward
      and backward of every micro-batch: 2m).
    Held, every stage moves 2Ψ(N−1)/N per step, as a single data-parallel step; per micro-batch the gradient
    share is m times that (stage 3: 3mΨ(N−1)/N)."""
    _check_count("stage_numel", stage_numel, 0)
    _check_count("dp", dp, 1)
    _check_count("micro_batches", micro_batches, 1)
    if zero_stage not in STAGES:
        raise ValueError(f"zero_stage={zero_stage!r} is not a ZeRO stage; valid stages are {list(STAGES)}")
    share = stage_numel * (dp - 1) / dp
    reductions = 1 if hold else micro_batches
    if zero_stage == 0:
        return 2 * share * reductions
    if zero_stage in (1, 2):
        return share * reductions + share
    gathers = 1 if hold else 2 * micro_batches
    return share * reductions + share * gathers
