"""0/1 Adam's math on one process: the interval policy, the per-step kinds, DeepSpeed 0.19.6's own class."""

from __future__ import annotations

import pytest
import torch
from onebit_reference import problem, run_ours

from shardspeed.compression.zero_one_adam import ZeroOneAdam, ZeroOneSchedule, advance, step_kind


def _ds_counters(steps: int, vfs: int, vus: int, lss: int, lsc: int) -> list[tuple]:
    """A transcription of DeepSpeed's per-parameter counter updates in ZeroOneAdam.step (from its first real step)."""
    s, var_interval, var_counter, lsi, lsc_counter, freeze = 1, 1, 0, 1, 0, False
    seen = []
    for _ in range(steps):
        s += 1
        if not freeze:
            kind = "variance" if s % var_interval == 0 else "compressed"
        else:
            kind = "sync" if s % lsi == 0 else "local"
        if not freeze:
            if s % var_interval == 0:
                var_counter += 1
                if var_counter == vus:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            lsc_counter += 1
            if lsc_counter == lss:
                lsc_counter, lsi = 0, min(lsc, lsi * 2)
        if s > vfs:
            freeze = True
        seen.append((kind, s, var_interval, var_counter, lsi, lsc_counter))
    return seen


@pytest.mark.parametrize("vfs,vus,lss,lsc", [(12, 2, 2, 4), (40, 3, 1, 8), (5, 2, 3, 2), (0, 2, 2, 4), (1, 2, 2, 4)])
def test_schedule_matches_deepspeeds_counters(vfs: int, vus: int, lss: int, lsc: int) -> None:
    schedule, seen = ZeroOneSchedule(step=1), []  # after DeepSpeed's initialization step
    for _ in range(80):
        kind = step_kind(schedule, vfs)
        schedule = advance(schedule, vfs, vus, lss, lsc)
        seen.append((kind, schedule.step, schedule.var_interval, schedule.var_counter,
                     schedule.local_step_interval, schedule.local_step_counter))  # fmt: skip
    assert seen == _ds_counters(80, vfs, vus, lss, lsc)
    kinds = [k for k, *_ in seen]
    assert {"variance", "sync"} <= set(kinds) and (vfs < 3 or "compressed" in kinds)  # every phase exercised
    assert kinds[0] == "variance"  # DeepSpeed's first real step never runs frozen
    assert max(s[4] for s in seen) <= lsc


class RecordingComm:
    """World-2-like comm that records which means each step asks for (and halves compressed values)."""

    world = 2

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.resets = 0

    def exact_mean(self, tensors):
        self.calls.append("exact")

    def compressed_mean(self, key, tensor):
        self.calls.append(f"compressed:{key}")
        tensor.mul_(0.5)

    def compressed_means(self, key, tensors):
        self.calls.append(f"compressed:{key}:{len(tensors)}")
        for tensor in tensors:
            tensor.mul_(0.5)

    def reset_errors(self):
        self.resets += 1

    def errors_state_dict(self):
        return {}

    def load_errors_state_dict(self, sd):
        pass


def test_each_step_asks_for_the_means_its_kind_needs() -> None:
    params, grads = problem(1, 20, shapes=((4, 3), (5,)))
    live = [torch.nn.Parameter(t.clone()) for t in params]
    opt = ZeroOneAdam(live, lr=0.01, var_freeze_step=12, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
    comm = RecordingComm()
    opt.bind_comm(comm)
    for p in live:
        p.grad = torch.ones_like(p)
    opt.step()  # DeepSpeed's initialization step: no communication, no update
    assert comm.calls == [] and all(torch.equal(p.detach(), t) for p, t in zip(live, params, strict=True))
    expected = _ds_counters(20, 12, 2, 2, 4)
    for step_grads, (kind, *_) in zip(grads, expected, strict=True):
        for p, g in zip(live, step_grads, strict=True):
            p.grad = g.clone()
        v_before = [opt.state[p]["exp_avg_sq"].clone() for p in live] if opt.state else None
        comm.calls.clear()
        opt.step()
        want = {
            "variance": ["exact"],
            "compressed": ["compressed:params:2"],  # both parameters, each compressed apart, in one call
            "sync": ["compressed:params:2"],
            "local": [],
        }[kind]
        assert comm.calls == want, kind
        if v_before is not None and kind != "variance":  # the variance moves on variance steps only
            assert all(torch.equal(opt.state[p]["exp_avg_sq"], v) for p, v in zip(live, v_before, strict=True))
    assert comm.resets == 1  # once, when the local phase starts


def test_resume_from_state_dict_is_bit_exact() -> None:
    kwargs = {"lr": 0.01, "var_freeze_step": 5, "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 4}
    params, grads = problem(3, 16)
    straight, _ = run_ours(ZeroOneAdam, kwargs, params, grads, first_step=False)
    live = [torch.nn.Parameter(t.clone()) for t in params]
    first = ZeroOneAdam(live, **kwargs)
    for step_grads in grads[:9]:  # stop inside the local phase, with an accumulator and lrs pending
        for p, g in zip(live, step_grads, strict=True):
            p.grad = g.clone()
        first.step()
    saved = first.state_dict()
    second = ZeroOneAdam(live, **kwargs)
    second.load_state_dict(saved)
    for step_grads in grads[9:]:
        for p, g in zip(live, step_grads, strict=True):
            p.grad = g.clone()
        second.step()
    assert all(torch.equal(p.detach(), w) for p, w in zip(live, straight[-1], strict=True))


def test_rejects_bad_hyperparameters() -> None:
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="var_update_scaler"):
        ZeroOneAdam(p, var_update_scaler=0)
    with pytest.raises(ValueError, match="betas"):
        ZeroOneAdam(p, betas=(1.0, 0.9))


def test_a_parameter_without_gradient_keeps_the_shared_schedule() -> None:
    frozen, live = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))
    opt = ZeroOneAdam([frozen, live], lr=0.01, var_freeze_step=3, var_update_scaler=2)
    for _ in range(6):
        live.grad = torch.ones(4)
        opt.step()
    assert frozen.grad is None and torch.equal(frozen.detach(), torch.ones(3))  # never updated
    assert opt.state[frozen]["step"] == opt.state[live]["step"] == 6
    assert opt.schedule().var_interval == opt.state[live]["var_interval"]


def test_a_parameter_without_gradient_takes_part_in_every_mean() -> None:
    """Ranks may differ in which parameters got a gradient: the means must not (same keys, same calls)."""
    idle, live = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))
    opt = ZeroOneAdam([idle, live], lr=0.01, weight_decay=0.1, var_freeze_step=4, var_update_scaler=1)
    comm = RecordingComm()
    opt.bind_comm(comm)
    for p in (idle, live):
        p.grad = torch.ones_like(p)
    opt.step()  # states for both
    idle.grad = None
    kinds = []
    for _ in range(8):
        live.grad = torch.ones(4)
        comm.calls.clear()
        kinds.append(step_kind(opt.schedule(), opt.var_freeze_step))
        opt.step()
        if kinds[-1] in ("compressed", "sync"):
            assert comm.calls == ["compressed:params:2"], kinds[-1]
    assert {"compressed", "sync"} <= set(kinds)
    assert (idle.detach() < 1).all()  # a zero gradient: weight decay still applies


class KnownMeanComm:
    """World-2-like comm whose compressed mean returns a known ĝ (independent of what was sent)."""

    world = 2

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def exact_mean(self, tensors):
        return None

    def compressed_mean(self, key, tensor):
        tensor.copy_(self.value.view_as(tensor))

    def compressed_means(self, key, tensors):
        for tensor in tensors:
            self.compressed_mean(key, tensor)

    def reset_errors(self):
        return None


def test_compressed_variance_phase_step_written_independently() -> None:
    """A compressed step (0/1 Adam before var_freeze_step, off the variance interval), from zoadam.py's formulas:
    m = b1·m + (1-b1)·ĝ with ĝ the 1-bit mean, v unchanged, w -= lr·(m/(√v+eps) + wd·w)."""
    lr, (b1, b2), eps, wd = 0.05, (0.8, 0.9), 1e-3, 0.1
    gen = torch.Generator().manual_seed(5)
    p = torch.nn.Parameter(torch.randn(7, generator=gen))
    g_hat = torch.randn(7, generator=gen)
    opt = ZeroOneAdam([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, var_freeze_step=50, var_update_scaler=1)
    opt.bind_comm(KnownMeanComm(g_hat))
    for _ in range(2):  # the initialization step, then one exact variance step (counter 2)
        p.grad = torch.randn(7, generator=gen)
        opt.step()
    assert step_kind(opt.schedule(), opt.var_freeze_step) == "compressed"
    w0, m0, v0 = p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()
    assert v0.abs().sum() > 0 and m0.abs().sum() > 0
    p.grad = torch.randn(7, generator=gen)  # the local gradient: replaced by the mean
    opt.step()
    m = b1 * m0 + (1 - b1) * g_hat
    w = w0 - lr * (m / (v0.sqrt() + eps) + wd * w0)
    assert torch.equal(opt.state[p]["exp_avg_sq"], v0)
    torch.testing.assert_close(opt.state[p]["exp_avg"], m, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(p.detach(), w, rtol=1e-6, atol=1e-7)


def test_local_phase_rows_restore_at_the_same_world_and_reset_elsewhere() -> None:
    """[Note: 0/1 Adam between syncs in checkpoints]: same world, this rank's own parameter and momentum come
    back; another world, the parameter restarts from the last synchronized value with no accumulated update."""
    kwargs = {"lr": 0.01, "var_freeze_step": 2, "local_step_scaler": 1, "local_step_clipper": 4}
    p = torch.nn.Parameter(torch.ones(5))
    opt = ZeroOneAdam([p], **kwargs)
    for k in range(6):
        p.grad = torch.full((5,), 0.1 * (k + 1))
        opt.step()
    state = opt.state[p]
    assert step_kind(opt.schedule(), opt.var_freeze_step) == "local" or state["lrs"] > 0
    assert not torch.equal(p.detach(), state["synced_param"])  # between syncs
    rows = {k: v.clone() for k, v in opt.compression_state_dict().items()}  # views of the live tensors
    own_p, own_m, lrs = p.detach().clone(), state["exp_avg"].clone(), state["lrs"]
    p.data.zero_()
    state["exp_avg"].zero_()
    opt.load_compression_state_dict(rows, same_world=True)
    assert torch.equal(p.detach(), own_p) and torch.equal(state["exp_avg"], own_m) and state["lrs"] == lrs
    opt.load_compression_state_dict(rows, same_world=False)
    assert torch.equal(p.detach(), state["synced_param"]) and state["lrs"] == 0.0


def test_error_buffers_of_the_per_parameter_layout_are_dropped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A checkpoint from the releases that kept one compressor per parameter (keys ``"0.0"``, ``"0.1"``) holds
    error buffers no compressor of this layout claims (one ``"params"`` compressor): the first 1-bit step drops
    them with one warning naming them, and the errors restart at zero (nothing lingers in the next save)."""
    live = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))]
    opt = ZeroOneAdam(live, lr=0.01, var_freeze_step=50, var_update_scaler=1)
    opt.bind_comm(RecordingComm())
    old = {f"0.{j}/{name}": torch.zeros(16) for j in range(2) for name in ("worker_error", "server_error")}
    opt.load_compression_state_dict(old, same_world=True)
    assert set(opt.compression_state_dict()) == set(old)  # kept as loaded until a step shows the layout
    kinds = []
    with caplog.at_level("WARNING", logger="shardspeed"):
        for _ in range(4):
            for p in live:
                p.grad = torch.ones_like(p)
            kinds.append(step_kind(opt.schedule(), opt.var_freeze_step))
            opt.step()
    assert "compressed" in kinds
    dropped = [r.getMessage() for r in caplog.records if "match no compressor" in r.getMessage()]
    assert len(dropped) == 1 and "'0.0'" in dropped[0] and "'0.1'" in dropped[0], dropped
    assert opt.compression_state_dict() == {}
