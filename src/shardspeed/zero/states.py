"""The interface the engine sees for a stage's model states (parameters, gradients, optimizer tensors)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from shardspeed.precision.norm_weights import NormScope
from shardspeed.zero.arrival_order import LayoutPlanner, agree_on_order, swap_optimizer_tensors
from shardspeed.zero.grad_markers import SteppedGrads
from shardspeed.zero.grad_sync import CommContext
from shardspeed.zero.hold import FlatHold
from shardspeed.zero.layout import ShardLayout
from shardspeed.zero.param_groups import PackedParams
from shardspeed.zero.reducer import GradReducer


class ModelStates(Protocol):
    reducer: GradReducer  # or Stage3Runtime: the same backward protocol
    communicate_every_micro_step: bool  # stage 2 reduces on every backward, stages 0/1 only on the boundary

    @property
    def peak_bucket_bytes(self) -> int:
        """Transient communication memory high-water mark (reported apart from the model states)."""
        ...

    @property
    def padded_numel(self) -> int:
        """Elements of the (padded) flat parameter space this stage shards; Ψ_padded of the memory model."""
        ...

    @property
    def num_params(self) -> int:
        """Number of packed parameters (indices used by tensor_segments)."""
        ...

    def tensor_segments(self) -> dict[int, list[tuple[int, int, int]]]:
        """Per optimizer tensor (by id): (parameter index, start, end) of each parameter piece inside it."""
        ...

    @property
    def param_names(self) -> list[str]:
        """The parameters' names by the index ``tensor_segments`` uses."""
        ...

    def optimizer_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The user's groups with their parameters replaced by the tensors the optimizer must step."""
        ...

    def bind_norm(self, scope: NormScope) -> None:
        """Which parameters this rank leaves out of the norm and where partial sums are added ([Note: norm counted
        once] in precision/norm_weights.py); until called: everything counted, the stage's own axis."""
        ...

    def grad_sq_sum(self) -> float:
        """Σ g² over the whole model's reduced gradients, each element counted once (collective where gradients
        are sharded or the model is split over a tensor/pipe axis: ``bind_norm``)."""
        ...

    def nonfinite_grad_names(self) -> list[str]:
        """Names of the parameters whose reduced gradient, as far as this rank holds it (stage 0: whole; sharded
        stages: its shard), has a NaN/Inf element. Local, no collective: only called on the non-finite path
        ([Note: non-finite steps] in training/nonfinite.py)."""
        ...

    def scale_grads(self, factor: float) -> None: ...

    def after_optimizer_step(self) -> None:
        """Make the model's parameters reflect the optimizer's update (copy back / all-gather)."""
        ...

    def wait_params(self) -> None:
        """Block until every pending parameter gather of the last step has landed ([Note: overlapped parameter
        gather] in zero/param_gather.py). Idempotent, cheap when nothing is pending; everything that reads or writes
        parameters outside a forward calls it first. Only stages 1/2 leave gathers pending."""
        ...

    def zero_grads(self) -> None: ...

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every persistent buffer this stage allocated, by role (for memory accounting)."""
        ...

    def bind_optimizer(self, optimizer: Any, groups: list[dict[str, Any]]) -> None:
        """The engine's optimizer exists (stages 0-2 re-lay their buckets out from the first backward)."""
        ...

    def verify_unit_order(self) -> None:
        """The step boundary: raise if ranks ran different ZeRO-3 units (stage 3 reads its deferred checks)."""
        ...

    def explain_backward_error(self, error: BaseException, loss: torch.Tensor) -> BaseException:
        """A clearer error for ``error`` raised by autograd in backward when the stage knows its cause, else
        ``error`` itself (stage 3: parameters read as empty placeholders outside forward)."""
        ...

    def sweep_cleared(self) -> int:
        """Forget what user code cleared since the last sweep (``module.zero_grad()``, ``optimizer.zero_grad()``:
        [Note: gradient markers]); returns how many clearings were seen (0: none)."""
        ...

    def mark_grads_clean(self) -> None:
        """The engine itself just wrote the gradients (end of backward, zeroing): the state to compare with."""
        ...

    # [Note: step-scoped hold] in zero/hold.py: the pipeline driver's protocol
    def begin_hold(self) -> None:
        """Start of a pipeline step (ZeRO-3: units stay gathered from their first use until ``reduce_held``)."""
        ...

    def held_grad(self, name: str) -> torch.Tensor:
        """The local accumulated, unreduced gradient of ``name`` (master dtype, writable, the parameter's shape)."""
        ...

    def reduce_held(self) -> None:
        """Reduce everything held over the data axis, as a final boundary backward would."""
        ...

    def abort_hold(self) -> None:
        """The step raised: forget what was held, release what the hold kept gathered (no collective)."""
        ...


def has_nonfinite(t: torch.Tensor) -> bool:
    return not bool(torch.isfinite(t).all())


def sweep_cleared(reducer: Any, stepped: SteppedGrads, forget_all: Callable[[], None], written_means_all: bool) -> int:
    """Shared by every stage. The optimizer's tensors' ``.grad`` set to None (``optimizer.zero_grad()``) forgets
    everything; in-place zeroing of the stage's gradient storage already zeroed what it reached (stage 1:
    ``optimizer.zero_grad(set_to_none=False)`` reaches only this rank's slices, so everything is forgotten);
    parameters whose marker was cleared are forgotten one by one."""
    events = 0
    if stepped.detached():
        stepped.reattach()
        forget_all()
        events = 1
    elif stepped.written():
        events = 1
        if written_means_all:
            forget_all()
    cleared = reducer.markers.cleared()
    if cleared:
        reducer.forget(cleared)
    stepped.snapshot()
    return events + len(cleared)


class FlatLayoutStates(FlatHold):
    """Shared by the stages whose states follow one ShardLayout (0, 1, 2), including the re-layout from the first
    backward's gradient arrival order ([Note: arrival-order layout] in zero/arrival_order.py)."""

    layout: ShardLayout
    reducer: GradReducer
    packed: PackedParams
    ctx: CommContext
    planner: LayoutPlanner

    def _relayout(self, layout: ShardLayout, optimizer: torch.optim.Optimizer) -> None:
        """Rebuild every layout-dependent buffer for ``layout``, moving parameter values, gradients, fp32 masters
        and the optimizer's states (present when a checkpoint was loaded before the first backward)."""
        raise NotImplementedError

    def verify_unit_order(self) -> None:
        """Nothing to verify: stages 0-2 have no units."""

    def wait_params(self) -> None:
        """Nothing pending: stage 0 copies back in place; stages 1/2 override it (zero/param_gather.py)."""

    def _stepped_grads(self) -> SteppedGrads:
        """The optimizer's tensors whose ``.grad`` are the stage's (stage 0 fp32: the parameters, whose markers
        already cover them) and the storages behind those gradients."""
        raise NotImplementedError

    def _clears_everything_when_written(self) -> bool:
        return False

    def sweep_cleared(self) -> int:
        return sweep_cleared(
            self.reducer, self._stepped_grads(), self.zero_grads, self._clears_everything_when_written()
        )

    def mark_grads_clean(self) -> None:
        self._stepped_grads().snapshot()

    def explain_backward_error(self, error: BaseException, loss: torch.Tensor) -> BaseException:
        return error

    def bind_optimizer(self, optimizer: Any, groups: list[dict[str, Any]]) -> None:
        """The engine's optimizer exists: plan the layout from the first backward. A torch optimizer's tensors are
        swapped; a streamed offload optimizer is rebuilt for the new layout (zero/relayout_streamed.py)."""

        def plan(arrived: list[int]) -> bool:
            order = agree_on_order(arrived, self.packed.names, self.layout, self.ctx.collectives, self.ctx.axis)
            layout = self.planner.build(order)
            if layout == self.layout:
                return True
            if isinstance(optimizer, torch.optim.Optimizer):
                self._relayout(layout, optimizer)
                swap_optimizer_tensors(optimizer, lambda: self.optimizer_groups(groups))
            else:
                self._relayout_streamed(layout, optimizer, groups)
            return True

        self.reducer.plan_layout = plan

    def _relayout_streamed(self, layout: ShardLayout, optimizer: Any, groups: list[dict[str, Any]]) -> None:
        """Re-lay out under a streamed offload optimizer (stages 1/2 only: the config refuses it at stage 0)."""
        raise NotImplementedError(f"{type(optimizer).__name__} cannot follow a re-layout at this stage")

    def optimizer_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        raise NotImplementedError

    @property
    def padded_numel(self) -> int:
        return self.layout.total

    @property
    def num_params(self) -> int:
        return len(self.layout.numels)

    @property
    def param_names(self) -> list[str]:
        return list(self.packed.names)
