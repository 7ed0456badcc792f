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

Who waits: the owning modules' pre-hooks (and their ancestors', [Note: owners read without their forward]); a
forward hook on the root module lands whatever is still pending when the root forward returns (buckets of unused
parameters), so backward and the next step never see a pending gather; and every engine API that reads or writes
parameters outside a forward calls ``ModelStates.wait_params()`` first (state dicts, checkpoints, ``parameters()``,
``GatheredParameters``, ``safe_get_*``, the optimizer step — in fp32 the optimizer steps the
parameter buffer's own slice in place). Recompute under activation checkpointing re-runs the pre-hooks: everything
is LANDED by then, so they return at once.

The wrapped model's own ``state_dict()`` and ``load_state_dict()`` wait too (hooks on the root module).

[Note: owners read without their forward] A module's parameters may be read by an ancestor without the module's
own forward running: torch's ``MultiheadAttention`` (so every ``nn.Transformer*``) passes ``out_proj.weight`` to
``F.multi_head_attention_forward``; a pipeline stage calls a tied layer's ``forward_fn`` with the module
(pipe/module.py). So every module holding a gathered parameter (itself or below) gets a pre-hook, the root
included, and the hooks record which of them fire until the first launch that follows a forward of the root (the
forwards before the first ``step()``, training or eval; a checkpoint load or ``safe_set_*`` before any forward
launches too, but lands its gathers at once). While recording, a hook that finds gathers pending lands them all
(correct before the rule is known; normally nothing is pending then). At that launch each owner whose hook never
fired hands its parameters to the nearest ancestor whose hook did (``settle_waits``; the root when none did),
which then waits for them before it runs. Later forwards may take other branches:
an owner whose own hook fires later waits again, which is idempotent. The rule decides only where a rank *waits*,
never what it launches, so it may differ between ranks.

What is not covered: a parameter read, between ``step()`` and the forward that lands its bucket, other than
through a hooked module's forward, the root's state-dict methods or the engine's API — ``model.parameters()`` /
``module.weight.data`` read directly, a submodule called on its own while another submodule's bucket is pending,
a child read without its forward by a branch of a later forward, when the forwards before the first step did call
the child (so its buckets were left to its own pre-hook). Such a read can see a partly written bucket (a rank's
peers may launch their half of the gather much later than it returns from ``step()``); read through the engine,
call ``engine.states.wait_params()`` first, or set ``overlap_param_gather: false``, which waits every gather
inside ``step()``. A tied parameter registered in several modules (a tied embedding / LM head) is owned by each
of them, so it is waited for by whichever runs first.
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


def hooked_modules(root: torch.nn.Module, params: Sequence[torch.Tensor]) -> list[torch.nn.Module]:
    """The modules that get a pre-hook: the root first, then every module under it holding one of ``params``
    (itself or through a child), in ``root.modules()`` order."""
    wanted = {id(p) for p in params}
    out = [root]
    for module in root.modules():
        if module is not root and any(id(p) in wanted for p in module.parameters()):
            out.append(module)
    return out


def owned_by(hooked: Sequence[torch.nn.Module], params: Sequence[torch.Tensor]) -> list[list[int]]:
    """For each hooked module: the indices of ``params`` it registers itself (a tied one under each owner)."""
    index = {id(p): i for i, p in enumerate(params)}
    return [[index[id(p)] for p in m.parameters(recurse=False) if id(p) in index] for m in hooked]


def settle_waits(hooked: Sequence[torch.nn.Module], owned: Sequence[Sequence[int]], fired: set[int]) -> list[list[int]]:
    """What each hooked module waits for once the recording ends ([Note: owners read without their forward]):
    its own parameters if its pre-hook fired, plus those of every owner below it that never fired and has no
    nearer fired ancestor; slot 0 (the root) takes those that have no fired ancestor at all."""
    slot_of = {id(m): i for i, m in enumerate(hooked)}
    parent: dict[int, int] = {}
    for i, module in enumerate(hooked):
        for child in module.children():
            j = slot_of.get(id(child))
            if j is not None and j != 0:
                parent.setdefault(j, i)  # a module shared under two parents: the first in modules() order
    waits: list[list[int]] = [list(o) if i in fired else [] for i, o in enumerate(owned)]
    for i, params in enumerate(owned):
        if i in fired or not params:
            continue
        target = parent.get(i, 0)
        while target != 0 and target not in fired:
            target = parent.get(target, 0)
        waits[target].extend(params)
    return waits


class ParamGather:
    """The post-step parameter gathers of one ``PartitionedStates`` and the hooks that wait for them."""

    def __init__(self, root: torch.nn.Module | None, params: Sequence[torch.Tensor]) -> None:
        self.phase = GatherPhase.IDLE
        self._buckets: list[BucketGather] = []
        self._inflight: dict[int, tuple[Work, torch.Tensor]] = {}
        self._needs: list[tuple[int, ...]] = []
        self._param_buckets: list[tuple[int, ...]] = []
        self.waited: list[int] = []
        """Buckets in the order they were landed since the last launch (tests read it)."""
        self._handles: list[RemovableHandle] = []
        self._hooked: list[torch.nn.Module] = hooked_modules(root, params) if root is not None else []
        self._owned = owned_by(self._hooked, params)
        self._waits_for: list[list[int]] = [list(owned) for owned in self._owned]
        self._recording = root is not None
        self._fired: set[int] = set()
        for slot, module in enumerate(self._hooked):
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(slot)))
        if root is not None:  # last: a root that owns parameters itself waits for them in its pre-hook first
            self._handles.append(root.register_forward_hook(lambda *_: self.wait_all()))
            # the wrapped model's own state_dict() / load_state_dict() (a load landing under a pending gather would
            # be overwritten by it)
            self._handles.append(root.register_state_dict_pre_hook(lambda *_: self.wait_all()))
            self._handles.append(root.register_load_state_dict_pre_hook(lambda *_: self.wait_all()))

    def _pre_hook(self, slot: int) -> Callable[[torch.nn.Module, object], None]:
        def hook(module: torch.nn.Module, args: object) -> None:
            if self._recording:  # [Note: owners read without their forward]
                self._fired.add(slot)
                self.wait_all()  # the waits are not settled yet: nothing may be read pending
                return
            if self.phase is GatherPhase.LAUNCHED:
                for k in self._needs[slot]:
                    self.wait_bucket(k)

        return hook

    def _settle(self) -> None:
        """End the recording: each owner whose pre-hook never fired hands its parameters to the nearest ancestor
        whose pre-hook did (the root, slot 0, when none did)."""
        self._recording = False
        self._waits_for = settle_waits(self._hooked, self._owned, self._fired)
        if self._param_buckets:
            self._needs = module_buckets(self._waits_for, self._param_buckets)

    def bind(self, spans: Sequence[tuple[int, int]], buckets: Sequence[tuple[int, int]]) -> None:
        """A (new) layout: which buckets each hooked module waits for. Only while nothing is pending."""
        assert self.phase is GatherPhase.IDLE, "re-layout with parameter gathers pending"
        self._buckets = [BucketGather.LANDED] * len(buckets)
        self._param_buckets = buckets_of_params(spans, buckets)
        self._needs = module_buckets(self._waits_for, self._param_buckets)

    @property
    def pending(self) -> int:
        """Buckets launched and not yet waited."""
        return len(self._inflight)

    def pending_buckets(self) -> list[int]:
        return sorted(self._inflight)

    def launch(self, k: int, work: Work, source: torch.Tensor) -> None:
        """Bucket ``k``'s gather was issued (``source``: its input, kept alive until the gather is waited)."""
        assert self._buckets[k] is BucketGather.LANDED, f"bucket {k} gathered while its last gather is pending"
        if self._recording and 0 in self._fired:  # a forward of the model was recorded (slot 0: the root)
            self._settle()
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
