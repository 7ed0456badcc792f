"""The step-scoped hold: gradients of every micro-batch of a pipeline step kept unreduced, reduced once at its end.

[Note: step-scoped hold] A pipeline stage runs the backward passes of a step's m micro-batches interleaved with
forwards of later ones (1F1B), and only the end of the step is an accumulation boundary. DeepSpeed refuses ZeRO-2/3
under pipeline parallelism because its stage 2 reduce-scatters on every backward and its stage 3 releases
parameters after every use. Here the pipeline driver holds instead (``pipeline.zero_hold: "step"``):

- each micro-batch: ``reducer.before_backward(communicate=False)`` … autograd … ``reducer.after_backward()``;
  the stage accumulates the local gradient in the master dtype (fp32, or bf16 with bf16 master weights), never
  in the wire or training dtype, so bf16 round-off does not swallow small per-micro-batch contributions:
    stage 0/1  the flat gradient buffer they always accumulate in (``GradSync.hold`` is ``absorb``);
    stage 2    a full-bucket buffer per bucket (grad_sync.py ``StagedReduceScatter.hold``), allocated at the
               bucket's first held gradient and freed as that bucket's reduce-scatter completes: during the step
               stage 2 has stage-1 gradient memory (4Ψ_stage more; ``memory_breakdown()["grad_hold"]``), at rest
               none (16Ψ/N-style ZeRO-2 figures hold between steps);
    stage 3    ``begin_hold()`` (start of the step) makes a unit gathered by its first use stay gathered until
               ``reduce_held`` (no release after forward, after a backward use, at the end of a backward, nor by
               ``stage3_max_live_parameters`` eviction): one all-gather per unit per step instead of one per use;
               each unit's gradients accumulate into a per-unit flat fp32 buffer (``UnitGrads.hold``);
- ``held_grad(name)``: a writable view, shaped like the parameter, of what is held for it (the tied-weight sum
  across pipeline stages is written into it before the reduction);
- ``reduce_held()``: one reduction of everything held, exactly as a final boundary backward with no new gradient
  would do it: stages 0-2 launch every bucket in bucket order (all-reduce at stage 0, reduce-scatter at 1/2),
  stage 3 every unit in unit order; ``on_final`` fires (offload's host copies), ``reducer.reduced`` is True after,
  unused parameters are those no micro-batch reached (zero gradients, checked as usual at the step). Stage 3 then
  releases its units;
- ``abort_hold()`` (the step raised): whatever was held is forgotten, units are released, no collective.

A backward that communicates after held ones (``no_sync``-style: hold, hold, …, then a final communicating
backward) reduces what was held together with its own gradients, at every stage (stage 2 adds its staging into the
held bucket, stage 3 its unit's gradients into the held buffer, before the reduce-scatter). The user-driven loop
still refuses ``no_sync()`` at stages 2/3 (training/micro_driver.py); nothing here depends on that.

The arrival-order re-layout of stages 0-2 ([Note: arrival-order layout] in arrival_order.py) still happens in the
first backward of the run (it records even when that backward does not communicate): it is a collective over the
data axis, which every data rank of a pipeline stage reaches at the same micro-batch. Graphs of later micro-batches
alive at that moment keep working: stages 1/2 point the parameters at the new flat buffer with the same values.
Per-micro-batch mode (``zero_hold: "micro_batch"``) calls none of this: every micro-batch communicates once (under
interleaving its earlier chunk backwards hold and its last reduces them with its own: [Note: one reduction per
micro-batch] in training/pipe_driver.py), at m× the gradient traffic (and at stage 3 gathers per use), for the least
memory; at stages 0/1 it saves nothing (``micro_batch_warning``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["HOLD_MODES", "FlatHold", "Stage3Hold", "holds_step", "micro_batch_warning", "unknown_name_error"]

HOLD_MODES: tuple[str, ...] = ("step", "micro_batch")


def holds_step(mode: str, tied_keys: Sequence[str] = ()) -> bool:
    """Whether a pipeline engine holds gradients for the step (``pipeline.zero_hold``), checked at construction:
    per-micro-batch reduction cannot take the tied-weight sum, which must be added into the unreduced gradient
    before the data-axis reduction (``held_grad``), so tied weights are refused there, naming them."""
    if mode not in HOLD_MODES:
        raise ValueError(f"pipeline.zero_hold={mode!r} is not one of {list(HOLD_MODES)}")
    if mode == "micro_batch" and tied_keys:
        raise ValueError(
            f"pipeline.zero_hold='micro_batch' cannot be used with tied weights across pipeline stages "
            f"({', '.join(sorted(tied_keys))}): their gradients are summed over the stages before the data-parallel "
            "reduction, which per-micro-batch mode runs inside every backward. Use zero_hold='step' (the default)."
        )
    return mode == "step"


def micro_batch_warning(mode: str, zero_stage: int) -> str | None:
    """The warning for ``zero_hold: "micro_batch"`` where it saves nothing: stages 0/1 accumulate in the full
    gradient buffer they keep anyway, so reducing per micro-batch only multiplies the gradient traffic by m."""
    if mode != "micro_batch" or zero_stage >= 2:
        return None
    return (
        f"pipeline.zero_hold='micro_batch' at zero_optimization.stage {zero_stage} only multiplies the gradient "
        "traffic by the micro-batches per step: stages 0/1 keep a full gradient buffer anyway, so there is no "
        "memory to save (it is meant for ZeRO-2/3). Use zero_hold='step' (the default)."
    )


def unknown_name_error(name: str, names: list[str]) -> KeyError:
    close = [n for n in names if name in n or n in name][:5]
    hint = f"; similar: {close}" if close else ""
    return KeyError(f"held_grad: '{name}' is not a trainable parameter this stage holds{hint}")


class FlatHold:
    """Stages 0-2's side of the hold (the flat-layout states mix it in)."""

    def _held_view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s held gradient in the master dtype (a view of a persistent buffer)."""
        raise NotImplementedError

    def begin_hold(self) -> None:
        """Stages 0-2: nothing to keep gathered."""

    def held_grad(self, name: str) -> torch.Tensor:
        names = self.packed.names  # type: ignore[attr-defined]
        index = self._name_index().get(name)
        if index is None:
            raise unknown_name_error(name, list(names))
        return self._held_view(index).view(self.packed.params[index].shape)  # type: ignore[attr-defined]

    def _name_index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.packed.names)}  # type: ignore[attr-defined]

    def reduce_held(self) -> None:
        self.reducer.reduce_held()  # type: ignore[attr-defined]

    def abort_hold(self) -> None:
        self.reducer.abort_backward()  # type: ignore[attr-defined]
        self.zero_grads()  # type: ignore[attr-defined]


class Stage3Hold:
    """ZeRO-3's side of the hold (Stage3States mixes it in): the runtime keeps units gathered, ``UnitGrads`` hold."""

    def begin_hold(self) -> None:
        self.reducer.begin_hold()  # type: ignore[attr-defined]

    def held_grad(self, name: str) -> torch.Tensor:
        for unit, grads in zip(self.units, self.grads):  # type: ignore[attr-defined]
            if name in unit.names:
                i = unit.names.index(name)
                if i in grads.trainable:
                    return grads.held_view(i)
        raise unknown_name_error(name, [n for u in self.units for n in u.names])  # type: ignore[attr-defined]

    def reduce_held(self) -> None:
        self.reducer.reduce_held()  # type: ignore[attr-defined]

    def abort_hold(self) -> None:
        self.reducer.abort_backward()  # type: ignore[attr-defined]
        self.zero_grads()  # type: ignore[attr-defined]
        self.reducer.end_hold()  # type: ignore[attr-defined]
