"""ZeRO-3 working set: how much of the model is gathered at once in forward and in backward, under activation
checkpointing (shardspeed's, torch's non-reentrant and reentrant), LoRA-style frozen weights, a module called twice
and a module skipped on some steps — bounded by ``stage3_max_live_parameters`` plus one unit — with parity against
plain torch; in-place ops on ZeRO-3 module outputs."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import shardspeed
from shardspeed import checkpointing
from shardspeed.zero.stage3.unit import UnitState

V, D, R, BLOCKS, SEQ, MB, STEPS = 32, 16, 4, 8, 4, 2, 3
ADAM = {"lr": 0.01, "weight_decay": 0.0, "eps": 1e-6}
CASES = [
    "plain",
    "shardspeed_ckpt",  # non-reentrant (the default)
    "shardspeed_reentrant_ckpt",  # DeepSpeed's CheckpointFunction
    "torch_ckpt",
    "reentrant_ckpt",
    "lora",
    "lora_torch_ckpt",  # frozen base + adapters under non-reentrant checkpointing: PEFT with HF gradient checkpointing
    "called_twice",
    "skipped",
    "reused_far",
]
CHECKPOINTED = ("shardspeed_ckpt", "shardspeed_reentrant_ckpt", "torch_ckpt", "reentrant_ckpt")


class Block(nn.Module):
    """A residual MLP; under ``lora`` its Linear layers are frozen and a trainable low-rank adapter is added."""

    def __init__(self, lora: bool) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.lora = lora
        if lora:
            for p in (*self.up.parameters(), *self.down.parameters()):
                p.requires_grad_(False)
            self.a, self.b = nn.Linear(D, R, bias=False), nn.Linear(R, D, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.down(torch.tanh(self.up(h)))
        if self.lora:
            out = out + self.b(self.a(h))
        return out


class Net(nn.Module):
    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.embed = nn.Embedding(V, D)
        lora = case.startswith("lora")
        self.blocks = nn.ModuleList(Block(lora) for _ in range(BLOCKS))
        self.head = nn.Linear(D, V)
        if lora:
            self.embed.weight.requires_grad_(False)
        self.step = 0  # set by the training loops: block 5 of "skipped" runs on even steps only

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for k, block in enumerate(self.blocks):
            if self.case == "skipped" and k == 5 and self.step % 2 == 1:
                continue
            h = h + self._run(block, h)
            if self.case == "called_twice" and k == 3:
                h = h + self._run(block, h)
        if self.case == "reused_far":  # blocks 0 and 1 again: kept gathered for reuse until the limit says no
            h = h + self._run(self.blocks[0], h)
            h = h + self._run(self.blocks[1], h)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())

    def _run(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if self.case in ("shardspeed_ckpt", "shardspeed_reentrant_ckpt"):
            return checkpointing.checkpoint(block, h)
        if self.case in ("torch_ckpt", "lora_torch_ckpt"):
            return torch_checkpoint.checkpoint(block, h, use_reentrant=False)
        if self.case == "reentrant_ckpt":
            return torch_checkpoint.checkpoint(block, h, use_reentrant=True)
        return block(h)


def make_net(case: str) -> Net:
    torch.manual_seed(0)
    return Net(case)


def block_numel(case: str) -> int:
    return sum(p.numel() for p in make_net(case).blocks[0].parameters())


def batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        seq = torch.randint(0, V, (MB * world, SEQ + 1), generator=g)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def _config(case: str, limited: bool) -> dict:
    # prefetch one block ahead (the default bucket would prefetch this whole small model)
    zero: dict = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": block_numel(case)}
    if limited:  # at most two blocks gathered (plus what one call needs)
        zero["stage3_max_live_parameters"] = 2 * block_numel(case)
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": ADAM},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }


class Probe:
    """Gathered elements, sampled at every module's forward entry and exit (recomputations included) and whenever
    a module output's gradient is computed in backward; the peak per phase. Only reads unit states, so it measures
    any runtime the same way (the runtime's own ``peak_live_forward/backward`` must agree)."""

    def __init__(self, engine: object) -> None:
        self.units = engine.states.units
        self.phase = "forward"
        self.peak = {"forward": 0, "backward": 0}
        for m in engine.module.modules():
            m.register_forward_pre_hook(lambda *_: self.sample())
            m.register_forward_hook(self._after)

    def sample(self, *_: object) -> None:
        live = sum(u.numel for u in self.units if u.state is not UnitState.SHARDED)
        self.peak[self.phase] = max(self.peak[self.phase], live)

    def _after(self, module: nn.Module, args: object, output: object) -> None:
        self.sample()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self.sample)


def _train(rank: int, world: int, case: str, limited: bool, config: dict | None = None) -> dict:
    checkpointing.set_default_context(None)
    checkpointing.configure(use_reentrant=case == "shardspeed_reentrant_ckpt")
    model = make_net(case)
    config = config or _config(case, limited)
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config
    )
    probe = Probe(engine)
    forward, backward, losses = [], [], []
    for step, (tokens, targets) in enumerate(batches(world)):
        probe.peak = {"forward": 0, "backward": 0}
        rows = slice(rank * MB, (rank + 1) * MB)
        probe.phase = "forward"
        loss = engine(tokens[rows], targets[rows])
        probe.phase = "backward"
        engine.backward(loss)
        losses.append(float(loss.detach()))
        forward.append(probe.peak["forward"])
        backward.append(probe.peak["backward"])
        engine.step()
        engine.module.step = step + 1
    return {
        "state": engine.module_state_dict(),
        "losses": losses,
        "forward": forward[1:],  # from the second step on: the first has no recorded order yet
        "backward": backward[1:],
        "model_numel": sum(u.numel for u in engine.states.units),
        "biggest_unit": max(u.numel for u in engine.states.units),
        "gathered_after": engine.states.unsharded_units(),
    }


def _reference(case: str, world: int) -> dict[str, torch.Tensor]:
    model = make_net("lora" if case == "lora_torch_ckpt" else "plain" if case in CHECKPOINTED else case)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, **ADAM)
    for step, (tokens, targets) in enumerate(batches(world)):
        model.step = step
        opt.zero_grad()
        # per-rank means averaged = the global mean (equal rows per rank)
        loss = sum(model(tokens[r * MB : (r + 1) * MB], targets[r * MB : (r + 1) * MB]) for r in range(world))
        (loss / world).backward()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return model.state_dict()


def _limited_and_not(rank: int, world: int, case: str) -> dict:
    return {"limited": _train(rank, world, case, True), "unlimited": _train(rank, world, case, False)}


# Peak gathered fraction (peak gathered numel / model numel) without a max-live limit, prefetching one block: the
# block in use and the next one, in forward and in backward, for every case (recomputation happens while its
# block is gathered for its backward anyway). Deterministic: program order decides every gather and release.
TWO_BLOCKS = 2 * 1072 / (8 * 1072 + 512 + 544)  # the block in use and the one prefetched ahead
TWO_LORA_BLOCKS = 2 * 1200 / (8 * 1200 + 512 + 544)
FRACTIONS = {case: (TWO_BLOCKS, TWO_BLOCKS) for case in CASES} | {
    "lora": (TWO_LORA_BLOCKS, TWO_LORA_BLOCKS),
    "lora_torch_ckpt": (TWO_LORA_BLOCKS, TWO_LORA_BLOCKS),
    "reused_far": (2 * TWO_BLOCKS, 2 * TWO_BLOCKS),  # + blocks 0 and 1, kept for their other call (reuse distance)
}


@pytest.mark.parametrize("case", CASES)
def test_working_set_is_bounded_by_max_live_parameters(dist_run, case: str) -> None:
    """Gathered elements observed in forward and in backward stay ≤ stage3_max_live_parameters + one unit, the
    peak fraction without the limit is the recorded figure, and training equals plain torch (Adam, fp32, ≤ 1e-5)."""
    results = dist_run(_limited_and_not, 2, case)
    limit = 2 * block_numel(case)
    ref = _reference(case, 2)
    initial = make_net(case).state_dict()
    assert max((ref[k] - initial[k]).abs().max().item() for k in ref) > 1e-3  # it trained
    for both in results:
        r, free = both["limited"], both["unlimited"]
        assert all(0 < f <= limit + r["biggest_unit"] for f in r["forward"]), (r["forward"], limit)
        assert all(0 < b <= limit + r["biggest_unit"] for b in r["backward"]), (r["backward"], limit)
        if case == "reused_far":  # one block needed at a time: the units kept for reuse make room, not the limit
            assert max(r["forward"]) <= limit and max(r["backward"]) <= limit, (r["forward"], r["backward"], limit)
        fractions = (max(free["forward"]) / free["model_numel"], max(free["backward"]) / free["model_numel"])
        print(f"{case}: peak gathered fraction forward {fractions[0]:.4f} backward {fractions[1]:.4f}")
        assert fractions == pytest.approx(FRACTIONS[case], abs=1e-4), fractions
        for run in (r, free):
            assert run["gathered_after"] == []
            for name, value in ref.items():
                assert (run["state"][name] - value).abs().max().item() <= 1e-5, (case, name)


class InPlace(nn.Module):
    """In-place ops on ZeRO-3 module outputs: ``x = self.embed(t); x += self.pos`` and ``torch.relu_(self.fc(x))``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(SEQ, D))
        self.fc = nn.Linear(D, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x += self.pos
        h = torch.relu_(self.fc(x))
        for block in self.blocks:
            y = block(h)
            y.mul_(0.5)
            h = h + y
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def _train_inplace(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = InPlace()
    config = _config("plain", False)
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for tokens, targets in batches(world):
        rows = slice(rank * MB, (rank + 1) * MB)
        engine.backward(engine(tokens[rows], targets[rows]))
        engine.step()
    return engine.module_state_dict()


def test_in_place_ops_on_module_outputs(dist_run) -> None:
    results = dist_run(_train_inplace, 2)
    torch.manual_seed(0)
    model = InPlace()
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    for tokens, targets in batches(2):
        opt.zero_grad()
        loss = sum(model(tokens[r * MB : (r + 1) * MB], targets[r * MB : (r + 1) * MB]) for r in range(2)) / 2
        loss.backward()
        opt.step()
    for state in results:
        for name, value in model.state_dict().items():
            assert (state[name] - value).abs().max().item() <= 1e-5, name


def _no_backward_then_two_losses(rank: int, world: int) -> dict:
    """Forwards with grad but no backward (an evaluation loop without no_grad) leave nothing gathered and keep no
    graph alive ([Note: saved views]: no reference cycle through the pack hook); then one backward through two
    forwards' losses trains like plain torch."""
    checkpointing.set_default_context(None)
    model = make_net("plain")
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=_config("plain", True))
    (tokens, targets), rows = batches(world)[0], slice(rank * MB, (rank + 1) * MB)
    saved: list[weakref.ref] = []  # an activation the graph saves for backward: alive exactly as long as the graph
    engine.module.blocks[1].up.register_forward_hook(lambda m, args, out: saved.append(weakref.ref(args[0])))
    for _ in range(3):
        engine(tokens[rows], targets[rows])  # the loss is dropped: its graph must go with it
    freed = [ref() is None for ref in saved]
    gathered = engine.states.unsharded_units()
    half = slice(rank * MB, rank * MB + 1), slice(rank * MB + 1, (rank + 1) * MB)
    loss = (engine(tokens[half[0]], targets[half[0]]) + engine(tokens[half[1]], targets[half[1]])) / 2
    engine.backward(loss)
    engine.step()
    return {"freed": freed, "gathered": gathered, "state": engine.module_state_dict()}


def test_forward_without_backward_and_two_forwards_per_backward(dist_run) -> None:
    results = dist_run(_no_backward_then_two_losses, 2)
    model = make_net("plain")
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    tokens, targets = batches(2)[0]
    loss = sum(model(tokens[i : i + 1], targets[i : i + 1]) for i in range(2 * MB)) / (2 * MB)
    loss.backward()
    opt.step()
    for r in results:
        assert r["gathered"] == [] and r["freed"] == [True, True, True]
        for name, value in model.state_dict().items():
            assert (r["state"][name] - value).abs().max().item() <= 1e-5, name


def _combined(rank: int, world: int, nvme: str) -> dict:
    config = _config("lora_torch_ckpt", limited=True)
    config["bf16"] = {"enabled": True}
    config["zero_optimization"] |= {
        "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0},
        "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
    }
    return _train(rank, world, "lora_torch_ckpt", True, config)


def test_working_set_holds_with_lora_checkpointing_bf16_and_nvme_offload(dist_run, tmp_path) -> None:
    """The combination PEFT users train with: frozen base + adapters, non-reentrant checkpointing, bf16, parameters
    and optimizer states on NVMe. The same bound as above holds, nothing stays gathered, and it trains like the
    fp32 run (bf16 tolerance)."""
    results = dist_run(_combined, 2, str(tmp_path))
    limit = 2 * block_numel("lora_torch_ckpt")
    fp32_runs = dist_run(_train, 2, "lora_torch_ckpt", True)
    for r, fp32 in zip(results, fp32_runs):  # each rank's loss is its own rows' mean
        assert all(0 < f <= limit + r["biggest_unit"] for f in r["forward"]), (r["forward"], limit)
        assert all(0 < b <= limit + r["biggest_unit"] for b in r["backward"]), (r["backward"], limit)
        assert r["gathered_after"] == []
        assert r["losses"] == pytest.approx(fp32["losses"], rel=2e-2), (r["losses"], fp32["losses"])
