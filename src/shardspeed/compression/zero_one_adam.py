"""0/1 Adam (Lu et al. 2022, arXiv 2202.06009), DeepSpeed's ``ZeroOneAdam`` on any backend.

Per parameter, with ``d = sqrt(v) + eps`` and DeepSpeed's step counter ``s`` (no bias correction)::

    variance phase (s <= var_freeze_step):
        s % var_interval == 0:  g = exact mean of the local gradients;  v = b2*v + (1-b2)*g^2;  m = b1*m + (1-b1)*g
        otherwise:              g = 1-bit compressed mean (error-fed);  m = b1*m + (1-b1)*g     (v unchanged)
        w -= lr * (m / d + weight_decay * w)
    local phase (after var_freeze_step; v frozen):
        m = b1*m + (1-b1)*g_local;  u = m / d + weight_decay * w;  w -= lr*u;  lrs += lr
        every local_step_interval steps (a sync step), with w_s the parameter at the last sync:
            c = compressed mean of ((w - w_s) * d);  m = -c / lrs;  w = w_s + c / d;  w_s = w;  lrs = 0

``var_interval`` starts at 1 and doubles after every ``var_update_scaler`` variance updates;
``local_step_interval`` starts at 1 and doubles after every ``local_step_scaler`` local-phase steps, up to
``local_step_clipper``. The error buffers are zeroed when the local phase starts (they then track the
accumulated update, not gradients).

[Note: DeepSpeed's first step] DeepSpeed's first ``step()`` of its 1-bit optimizers only allocates their
communication buffers: the counter reaches 1, nothing is updated, that batch's gradient is dropped. We keep
that step as it is (as ``OneBitAdam`` does), so a run matches DeepSpeed's step for step and
``var_freeze_step`` / the interval policies select the same steps. Differences from DeepSpeed, each deliberate:
on a data axis of size 1 DeepSpeed skips the momentum update on compressed steps (its ``size > 1`` guard); we
take the (exact) mean as on any axis. The error buffers are kept in checkpoints (restored at the same world
size; DeepSpeed always resets them). AMSGrad is not supported. A param group's ``exp_avg_mask`` multiplies the
compressed means (of gradients in the variance phase, of the accumulated update at a sync) on more than one
rank, as in DeepSpeed. Each parameter is compressed on its own (its own padding, errors and scales), as
DeepSpeed does, but every parameter's 1-bit mean of a step travels in one set of collectives ([Note: partwise
compressed all-reduce]; DeepSpeed makes four per parameter). A parameter without ``.grad`` (but with states, i.e.
after the first step) counts as a zero gradient, as in ``OneBitLamb``: it still takes part in every mean (so ranks
that differ in which parameters got a gradient still make the same calls), its momentum decays and weight decay
applies (DeepSpeed skips such a parameter).

[Note: 0/1 Adam's accumulator] DeepSpeed sums the local updates into an accumulator ``acc`` and at a sync
undoes them (``w -= acc``) before adding the mean; in floating point ``(w - lr*u) - (-lr*u)`` is not ``w``, so
its ranks drift apart by rounding and never re-agree. We keep ``w_s`` (the parameter at the last sync, same
memory as ``acc``) and compress ``w - w_s``: equal to DeepSpeed's to rounding (the world-1 parity holds to
1e-6), and every rank rebuilds the identical ``w_s + c / d`` after each sync. Between syncs the ranks'
parameters differ by design (local steps).

[Note: 0/1 Adam between syncs in checkpoints] A checkpoint's model and optimizer states are written by data rank
0 only, but between syncs every rank's parameter and ``exp_avg`` are its own. So in the local phase both are
also saved as per-rank rows of the compression state ([Note: error buffers in checkpoints]): a load at the same
data-parallel world size gives every rank its own values back (bit-exact resume). At another world size the
rows mean nothing: every rank restarts from the last synchronized parameter ``synced_param`` (the same on every
rank) with rank 0's momentum and ``lrs = 0``, i.e. the local updates since the last sync are dropped (one
warning, with the error-buffer reset). ``lrs``, ``synced_param`` and ``exp_avg_sq`` are the same on every rank.

Communication is owned by the optimizer from the first step ([Note: optimizer-owned means] in
``owned_comm.py``): the engine hands over local gradients and the optimizer takes the exact mean itself on
variance steps (one flat all-reduce), which is what DeepSpeed's engine toggle ``enable_backward_allreduce``
achieves from the outside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from shardspeed.compression.onebit_adam import check_comm_backend_name
from shardspeed.compression.optim_base import mask_exp_avg_, trained
from shardspeed.compression.owned_comm import MeanCommOptimizer

_LOCAL = "local/"  # compression-state keys of the local phase's per-rank parameter and momentum rows
_MEANS_KEY = "params"  # the one compressor (and error-buffer key) of every parameter's 1-bit mean
_COUNTERS = ("var_interval", "var_counter", "local_step_interval", "local_step_counter")


@dataclass(frozen=True)
class ZeroOneSchedule:
    """0/1 Adam's interval policy state (DeepSpeed keeps it per parameter; every parameter holds the same)."""

    step: int = 0  # DeepSpeed's counter; its first step only allocates buffers ([Note: DeepSpeed's first step])
    var_interval: int = 1
    var_counter: int = 0
    local_step_interval: int = 1
    local_step_counter: int = 0


def is_frozen(schedule: ZeroOneSchedule, var_freeze_step: int) -> bool:
    """Whether the *next* step runs in the local phase (DeepSpeed freezes once its counter passed var_freeze_step)."""
    # DeepSpeed's first real step (counter 2) always runs before its freeze check: at var_freeze_step 0 or 1
    # the local phase starts with counter 3, as there.
    return schedule.step > max(var_freeze_step, 1)


def step_kind(schedule: ZeroOneSchedule, var_freeze_step: int) -> str:
    """What the next step does: ``"variance"`` (exact mean), ``"compressed"`` (1-bit mean of gradients),
    ``"local"`` (no communication) or ``"sync"`` (local step, then 1-bit mean of the accumulated update)."""
    s = schedule.step + 1
    if not is_frozen(schedule, var_freeze_step):
        return "variance" if s % schedule.var_interval == 0 else "compressed"
    return "sync" if s % schedule.local_step_interval == 0 else "local"


def advance(
    schedule: ZeroOneSchedule,
    var_freeze_step: int,
    var_update_scaler: int,
    local_step_scaler: int,
    local_step_clipper: int,
) -> ZeroOneSchedule:
    """The schedule after one step (DeepSpeed's counter updates at the end of ``ZeroOneAdam.step``)."""
    frozen = is_frozen(schedule, var_freeze_step)
    s = schedule.step + 1
    new = replace(schedule, step=s)
    if not frozen:
        if s % new.var_interval == 0:
            counter = new.var_counter + 1
            if counter == var_update_scaler:
                new = replace(new, var_counter=0, var_interval=new.var_interval * 2)
            else:
                new = replace(new, var_counter=counter)
    else:
        counter = new.local_step_counter + 1
        if counter == local_step_scaler:
            interval = min(local_step_clipper, new.local_step_interval * 2)
            new = replace(new, local_step_counter=0, local_step_interval=interval)
        else:
            new = replace(new, local_step_counter=counter)
    return new


def variance_phase_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    update_variance: bool,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One variance-phase step on one tensor; ``grad`` is already the (exact or compressed) mean."""
    beta1, beta2 = betas
    if update_variance:
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    update = exp_avg / (exp_avg_sq.sqrt() + eps)
    if weight_decay > 0.0:
        update += weight_decay * param
    param.add_(update, alpha=-lr)


def local_phase_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One local step on one tensor: momentum from the local gradient, no communication."""
    beta1 = betas[0]
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    update = exp_avg / (exp_avg_sq.sqrt() + eps)
    if weight_decay > 0.0:
        update += weight_decay * param
    param.add_(update, alpha=-lr)


def sync_payload(
    param: torch.Tensor, synced: torch.Tensor, exp_avg_sq: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """What a sync compresses: the update accumulated since the last sync, in momentum units (``acc * d``).
    ``out``: a buffer of the parameter's dtype to write it into (the step's spent gradient copy)."""
    if out is None or out.dtype != param.dtype:
        return (param - synced).mul_(exp_avg_sq.sqrt() + eps)
    return torch.sub(param, synced, out=out).mul_(exp_avg_sq.sqrt() + eps)


def sync_finish(
    param: torch.Tensor,
    synced: torch.Tensor,
    mean: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    eps: float,
    lrs: float,
) -> None:
    """After the compressed mean of the payload: the shared momentum, and the parameter rebuilt from the last
    synchronized value (so every rank holds the same bits; see [Note: 0/1 Adam's accumulator])."""
    exp_avg.copy_(mean / lrs).neg_()
    param.copy_(synced + mean / (exp_avg_sq.sqrt() + eps))
    synced.copy_(param)


class ZeroOneAdam(MeanCommOptimizer):
    """0/1 Adam with DeepSpeed's parameter names and defaults; the math is in the module docstring.

    Unbound (``bind`` not called) it runs as on a data axis of size 1. ``owns_communication`` is True from the
    first step: the engine must hand it local (1/GAS-scaled) gradients and leave the means to it.
    """

    shardspeed_elementwise = False  # the local-phase sync and the per-tensor compression scales are per tensor

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        bias_correction: bool = True,
        eps_inside_sqrt: bool = False,
        amsgrad: bool = False,
        max_grad_norm: float = 0.0,
    ) -> None:
        if amsgrad:
            raise ValueError("ZeroOneAdam has no AMSGrad variant (DeepSpeed refuses it too)")
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"ZeroOneAdam: lr, eps, weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"ZeroOneAdam: betas must each be in [0, 1), got {betas}")
        for name, value in (
            ("var_update_scaler", var_update_scaler),
            ("local_step_scaler", local_step_scaler),
            ("local_step_clipper", local_step_clipper),
        ):
            if int(value) != value or value < 1:
                raise ValueError(f"ZeroOneAdam: {name} must be an integer >= 1, got {value}")
        if int(var_freeze_step) != var_freeze_step or var_freeze_step < 0:
            raise ValueError(f"ZeroOneAdam: var_freeze_step must be an integer >= 0, got {var_freeze_step}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.var_freeze_step = int(var_freeze_step)
        self.var_update_scaler = int(var_update_scaler)
        self.local_step_scaler = int(local_step_scaler)
        self.local_step_clipper = int(local_step_clipper)
        # Accepted for DeepSpeed configs; the transport is the process group's backend through Collectives.
        self.cuda_aware = cuda_aware
        self.comm_backend_name = check_comm_backend_name(comm_backend_name)
        # DeepSpeed accepts these and never reads them (no bias correction, eps outside the root): so do we.
        self.bias_correction, self.eps_inside_sqrt = bias_correction, eps_inside_sqrt
        self.max_grad_norm = max_grad_norm  # accepted and never read, as in DeepSpeed (clipping: the engine's)

    # -- engine protocol -------------------------------------------------------------------------------------
    @property
    def owns_communication(self) -> bool:
        return True

    # -- state -----------------------------------------------------------------------------------------------
    def _params(self) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
        stepped = {id(p) for g in self.param_groups for p in trained(g["params"])}  # not frozen parameters
        return [
            (g, f"{i}.{j}", p)
            for i, g in enumerate(self.param_groups)
            for j, p in enumerate(g["params"])
            if id(p) in stepped
        ]

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = ZeroOneSchedule().step
            for name in _COUNTERS:
                state[name] = getattr(ZeroOneSchedule(), name)
            state["lrs"] = 0.0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def schedule(self) -> ZeroOneSchedule:
        """The interval policy state (read from the first stepped parameter; every one holds the same)."""
        members = self._params()
        state = (self.state.get(members[0][2]) or {}) if members else {}
        if not state:
            return ZeroOneSchedule()
        return ZeroOneSchedule(step=int(state["step"]), **{n: int(state[n]) for n in _COUNTERS})

    def _args(self) -> tuple[int, int, int, int]:
        return self.var_freeze_step, self.var_update_scaler, self.local_step_scaler, self.local_step_clipper

    # -- checkpoints ([Note: 0/1 Adam between syncs in checkpoints]) ---------------------------------------------
    def compression_state_dict(self) -> dict[str, torch.Tensor]:
        """The error buffers, plus in the local phase this rank's own parameter and momentum (``local/<key>/...``)."""
        out = super().compression_state_dict()
        for _, key, p in self._params():
            state = self.state.get(p) or {}
            if "synced_param" in state:
                out[f"{_LOCAL}{key}/param"] = p.detach().reshape(-1)
                out[f"{_LOCAL}{key}/exp_avg"] = state["exp_avg"].detach().reshape(-1)
        return out

    def load_compression_state_dict(self, state: dict[str, torch.Tensor], same_world: bool) -> None:
        """Same world: each rank's own local-phase parameter and momentum back. Another world (or rows missing):
        every rank restarts from the last synchronized parameter (``synced_param``, the same on every rank), with
        the saving rank 0's momentum and no accumulated update (``lrs = 0``)."""
        local = {k: v for k, v in state.items() if k.startswith(_LOCAL)}
        super().load_compression_state_dict({k: v for k, v in state.items() if k not in local}, same_world)
        for _, key, p in self._params():
            st = self.state.get(p) or {}
            if "synced_param" not in st:
                continue
            param, exp_avg = local.get(f"{_LOCAL}{key}/param"), local.get(f"{_LOCAL}{key}/exp_avg")
            if same_world and param is not None and exp_avg is not None:
                p.data.view(-1).copy_(param.reshape(-1))
                st["exp_avg"].view(-1).copy_(exp_avg.reshape(-1))
            else:
                p.data.copy_(st["synced_param"])
                st["lrs"] = 0.0

    # -- step ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # A parameter with states but no gradient counts as a zero gradient (as in OneBitLamb): every rank then
        # averages the same tensors under the same keys, and the parameter keeps re-syncing.
        members = [(g, key, p) for g, key, p in self._params() if p.grad is not None or self.state.get(p)]
        if not members:
            return loss
        schedule = self.schedule()
        if schedule.step == 0:  # [Note: DeepSpeed's first step]: states only, no update
            for _, _, p in self._params():
                self._state(p)["step"] = 1
            return loss
        kind = step_kind(schedule, self.var_freeze_step)
        grads = [  # local; the means go in place
            torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.detach().to(torch.float32, copy=True)
            for *_, p in members
        ]
        if kind == "variance":
            self.comm.exact_mean(grads)
        elif kind == "compressed":  # every parameter compressed apart, in one set of collectives
            self._compressed_means(grads)
        for (group, _, p), grad in zip(members, grads, strict=True):
            state = self._state(p)
            hyper = {"lr": group["lr"], "betas": group["betas"], "eps": group["eps"]}
            if kind in ("variance", "compressed"):
                if kind == "compressed" and self.comm.world > 1:  # DeepSpeed masks the 1-bit mean (world > 1)
                    mask_exp_avg_(group, grad)
                variance_phase_update(
                    p, grad, state["exp_avg"], state["exp_avg_sq"], update_variance=kind == "variance",
                    weight_decay=group["weight_decay"], **hyper,
                )  # fmt: skip
                continue
            if "synced_param" not in state:  # entering the local phase: every rank holds the same parameter
                state["synced_param"] = p.detach().clone()
            local_phase_update(
                p, grad, state["exp_avg"], state["exp_avg_sq"], weight_decay=group["weight_decay"], **hyper
            )
            state["lrs"] += group["lr"]
        if kind == "sync":  # the spent gradient copies hold the payloads: no extra memory
            payloads = [
                sync_payload(p, self.state[p]["synced_param"], self.state[p]["exp_avg_sq"], group["eps"], out=grad)
                for (group, _, p), grad in zip(members, grads, strict=True)
            ]
            self._compressed_means(payloads)
            for (group, _, p), payload in zip(members, payloads, strict=True):
                state = self.state[p]
                if self.comm.world > 1:
                    mask_exp_avg_(group, payload)
                synced = state["synced_param"]
                sync_finish(p, synced, payload, state["exp_avg"], state["exp_avg_sq"], group["eps"], state["lrs"])
                state["lrs"] = 0.0
        after = advance(schedule, *self._args())
        for *_, p in self._params():  # every parameter, with a gradient this step or not: one shared schedule
            state = self._state(p)
            state["step"] = after.step
            for name in _COUNTERS:
                state[name] = getattr(after, name)
        if is_frozen(after, self.var_freeze_step) and not is_frozen(schedule, self.var_freeze_step):
            # The errors tracked gradients; from now on they track accumulated updates (DeepSpeed resets too).
            self.comm.reset_errors()
        return loss

    def _compressed_means(self, tensors: list[torch.Tensor]) -> None:
        """The 1-bit mean of every parameter's tensor, each compressed apart (DeepSpeed's per-parameter scales),
        in one set of collectives (``PartwiseCompressedAllReduce``); gradients in the variance phase and the
        sync payloads in the local phase share the error buffers, as DeepSpeed's (reset between the phases)."""
        self.comm.compressed_means(_MEANS_KEY, tensors)
        self.drop_unclaimed_compression_state()
