"""Stages 1/2: the updated parameters' all-gather, launched by the optimizer step and waited by the next forward.

[Note: overlapped parameter gather] After the optimizer step each rank holds only its 1/N slice of every bucket
updated; the whole buckets come back by one all-gather each ([Note: bucket-major sharding] in zero/layout.py).
DeepSpeed waits for those gathers at the end of ``step()``, on the critical path. With
``zero_optimization.overlap_param_gather`` (Megatron-Core's distributed optimizer does the same) the step only
*launches* them and returns; the next forward waits for bucket k just before the first module that owns a
parameter in bucket k runs (a forward pre-hook per parameter-owning module, registered once at construction, as
ZeRO-3's units are gathered), so the gathers of later buckets travel while earlier layers compute.

State machine. The gather is IDLE (every bucket LANDED: the parameter buffer is whole and may be read or written)
or LAUNCHED (some buckets PENDING: their slice of the parameter buffer is being written by the collective).
``launch`` moves a bucket LANDED → PENDING, ``wait_bucket`` PENDING → LANDED (idempotent), ``wait_all`` lands
everything. The all-gather's input (a clone of the rank's slice, or the fp32 master slice cast to the training
dtype) is kept with the pending bucket: the backend reads it until the collective completes.

Launch order: every rank must issue the collectives in the same order, so the order is a function of the layout
alone (never of what one rank's forward happened to touch first). Buckets are laid out in backward arrival order
(data-parallel rank 0's, agreed: [Note: arrival-order layout]) — the last layers' parameters first — and a forward
uses them roughly in reverse, so buckets are launched last index first: the bucket the next forward needs first
is first on the wire. Waits are per bucket (only what the module needs), not "everything launched before it":
a backend may complete collectives out of order, and a module never waits for a bucket it does not read.

Who waits: the owning modules' pre-hooks; a forward hook on the root module lands whatever is still pending when
the root forward returns (buckets of unused parameters, or of parameters read only outside their owner), so
backward and the next step never see a pending gather; and every engine API that reads or writes parameters
outside a forward calls ``ModelStates.wait_params()`` first (state dicts, checkpoints, ``parameters()``,
``GatheredParameters``, ``safe_get_*``, the optimizer step — in fp32 the optimizer steps the parameter buffer's own
slice in place). Recompute under activation checkpointing re-runs the pre-hooks: everything is LANDED by then,
so they return at once.

The wrapped model's own ``state_dict()`` and ``load_state_dict()`` wait too (hooks on the root module).

What is not covered: a parameter read, between ``step()`` and the forward that lands its bucket, other than
through its owning module's forward, the root's state-dict methods or the engine's API — ``model.parameters()`` /
``module.weight.data`` read directly, a parent's forward using ``self.child.weight`` before the child's forward
ran, a submodule called on its own while another submodule's bucket is pending. Such a read can see a partly
written bucket (a rank's peers may launch their half of the gather much later than it returns from ``step()``). A tied
parameter registered in several modules (a tied embedding / LM head) is owned by each of them, so it is waited
for by whichever runs first. ``overlap_param_gather: false`` waits every gather inside ``step()``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from shardspeed.comm import Work


class GatherPhase(enum.Enum):
    IDLE = "idle"  # every bucket LANDED: the parameter buffer is whole
    LAUNCHED = "launched"  # at least one bucket PENDING


class BucketGather(enum.Enum):
    LANDED = "landed"
    PENDING = "pending"


# --- pure helpers ---------------------------------------------------------------------------------------------------
def buckets_of_params(spans: Sequence[tuple[int, int]], buckets: Sequence[tuple[int, int]]) -> list[tuple[int, ...]]:
    """For each parameter's flat span ``[lo, hi)``: the indices of the buckets ``[start, end)`` it overlaps (one,
    unless a parameter larger than a bucket was split across several)."""
    out = []
    for lo, hi in spans:
        out.append(tuple(k for k, (start, end) in enumerate(buckets) if lo < end and start < hi and lo < hi))
    return out


def module_buckets(owned: Sequence[Sequence[int]], param_buckets: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """For each module (the parameter indices it registers itself): the buckets its forward needs, ascending."""
    return [tuple(sorted({k for i in params for k in param_buckets[i]})) for params in owned]


def launch_order(num_buckets: int) -> list[int]:
    """The order every rank launches the gathers in: last bucket first ([Note: overlapped parameter gather])."""
    return list(range(num_buckets - 1, -1, -1))


def owning_modules(root: torch.nn.Module, params: Sequence[torch.Tensor]) -> list[tuple[torch.nn.Module, list[int]]]:
    """Every module under ``root`` that registers one of ``params`` itself (not through a child), with the indices of
    those parameters; a parameter registered in several modules (tied) is listed under each."""
    index = {id(p): i for i, p in enumerate(params)}
    out = []
    for module in root.modules():
        mine = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
        if mine:
            out.append((module, mine))
    return out


class ParamGather:
    """The post-step parameter gathers of one ``PartitionedStates`` and the hooks that wait for them."""

    def __init__(self, root: torch.nn.Module | None, params: Sequence[torch.Tensor]) -> None:
        self.phase = GatherPhase.IDLE
        self._buckets: list[BucketGather] = []
        self._inflight: dict[int, tuple[Work, torch.Tensor]] = {}
        self._needs: list[tuple[int, ...]] = []
        self.waited: list[int] = []
        """Buckets in the order they were landed since the last launch (tests read it)."""
        self._handles: list[RemovableHandle] = []
        owners = owning_modules(root, params) if root is not None else []
        self._owned = [indices for _, indices in owners]
        for slot, (module, _) in enumerate(owners):
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(slot)))
        if root is not None:  # last: a root that owns parameters itself waits for them in its pre-hook first
            self._handles.append(root.register_forward_hook(lambda *_: self.wait_all()))
            # the wrapped model's own state_dict() / load_state_dict() (a load landing under a pending gather would
            # be overwritten by it)
            self._handles.append(root.register_state_dict_pre_hook(lambda *_: self.wait_all()))
            self._handles.append(root.register_load_state_dict_pre_hook(lambda *_: self.wait_all()))

    def _pre_hook(self, slot: int) -> Callable[[torch.nn.Module, object], None]:
        def hook(module: torch.nn.Module, args: object) -> None:
            if self.phase is GatherPhase.LAUNCHED:
                for k in self._needs[slot]:
                    self.wait_bucket(k)

        return hook

    def bind(self, spans: Sequence[tuple[int, int]], buckets: Sequence[tuple[int, int]]) -> None:
        """A (new) layout: which buckets each owning module needs. Only while nothing is pending."""
        assert self.phase is GatherPhase.IDLE, "re-layout with parameter gathers pending"
        self._buckets = [BucketGather.LANDED] * len(buckets)
        self._needs = module_buckets(self._owned, buckets_of_params(spans, buckets))

    @property
    def pending(self) -> int:
        """Buckets launched and not yet waited."""
        return len(self._inflight)

    def pending_buckets(self) -> list[int]:
        return sorted(self._inflight)

    def launch(self, k: int, work: Work, source: torch.Tensor) -> None:
        """Bucket ``k``'s gather was issued (``source``: its input, kept alive until the gather is waited)."""
        assert self._buckets[k] is BucketGather.LANDED, f"bucket {k} gathered while its last gather is pending"
        if self.phase is GatherPhase.IDLE:
            self.waited = []
        self._buckets[k] = BucketGather.PENDING
        self._inflight[k] = (work, source)
        self.phase = GatherPhase.LAUNCHED

    def wait_bucket(self, k: int) -> None:
        """Land bucket ``k`` (no-op when it is not pending). A peer's failure raises here (``PeerFailedError``)."""
        entry = self._inflight.get(k)
        if entry is None:
            return
        entry[0].wait()  # blocked time recorded by Collectives under "<op>:params"
        del self._inflight[k]
        self._buckets[k] = BucketGather.LANDED
        self.waited.append(k)
        if not self._inflight:
            self.phase = GatherPhase.IDLE

    def wait_all(self) -> None:
        """Land every pending bucket, in launch order. Cheap when nothing is pending."""
        if self.phase is GatherPhase.IDLE:
            return
        for k in list(self._inflight):
            self.wait_bucket(k)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
