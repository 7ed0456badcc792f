"""``engine.flops_profiler``'s rules around the profiled step: evaluation forwards are not training FLOPs, the
MFU peak follows the dtype the matmuls run in, recompute is measured inside the checkpoint, the figures are formed
after the step phase, and profiling leaves training bit-identical."""

from __future__ import annotations

import torch

import shardspeed
from shardspeed.demo.model import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, context_length=16, n_layer=2, d_model=32, n_head=2)


def _engine(extra: dict) -> shardspeed.ShardSpeedEngine:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "steps_per_print": 1000,
        "flops_profiler": {"enabled": True, "profile_step": 1, "detailed": False},
        **extra,
    }
    engine, *_ = shardspeed.initialize(model=GPT(CFG), config=config)
    engine.flops_profiler._print = lambda text: None
    return engine


def gpt_formula(model: GPT, tokens: int, seq: int) -> int:
    weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "position" not in n)
    return 6 * tokens * weights + 12 * CFG.n_layer * seq * CFG.d_model * tokens


def test_evaluation_forwards_at_profile_step_are_not_counted() -> None:
    """Validation right after step N (N = profile_step): eval mode under no_grad, and a no_grad forward in train
    mode, neither open the window nor add to it; the training step after them is the one profiled."""
    engine = _engine({})
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    engine.backward(engine(tokens, tokens))
    engine.step()
    engine.eval()
    with torch.no_grad():
        for _ in range(3):
            engine(tokens, tokens)
    engine.train()
    with torch.no_grad():
        engine(tokens, tokens)
    assert engine.flops_profiler.state == "IDLE"
    engine.backward(engine(tokens, tokens))
    engine.step()
    profiler = engine.flops_profiler
    assert profiler.figures.phases["forward"].count == 1
    assert profiler.model_flops_per_sample == gpt_formula(engine.module, 16, 16)


def test_mfu_peak_uses_the_autocast_dtype(monkeypatch) -> None:
    """fp32 parameters under ``torch_autocast`` bf16: the matmuls run in bf16, so the peak is the bf16 column
    (the table path, with the device name faked)."""
    from shardspeed.profiling import mfu

    engine = _engine({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
    assert engine.flops_profiler.compute_dtype == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(mfu, "_CACHE", {})
    peak = mfu.peak_flops(torch.device("cuda", 0), engine.flops_profiler.compute_dtype)
    assert peak == mfu.table_peak("NVIDIA H200", "bf16") and "bf16" in peak.source


def test_recompute_of_a_checkpointed_bound_method_is_measured_inside_it() -> None:
    """Megatron's "checkpoint the core attention": ``attn.forward`` (a bound method whose own body runs SDPA)
    checkpointed with shardspeed.checkpointing. The recompute is measured inside the checkpoint's recompute scope,
    so the SDPA recomputed outside any submodule call is not charged to backward."""
    import functools

    from shardspeed import checkpointing

    engine = _engine({"flops_profiler": {"enabled": True, "profile_step": 0}})
    for block in engine.module.blocks:
        block.attn.forward = functools.partial(checkpointing.checkpoint, block.attn.forward)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    engine.backward(engine(tokens, tokens))
    engine.step()
    profiler = engine.flops_profiler
    attn_forward = sum(s.fwd_flops for s in profiler.figures.modules if s.path.endswith(".attn"))
    assert attn_forward > 0 and profiler.figures.recompute_flops == attn_forward
    assert profiler.model_flops_per_sample == gpt_formula(engine.module, 16, 16)


def test_figures_are_formed_after_the_step_phase() -> None:
    """The all-reduce, the peak probe and the printout run once the ``step`` phase has ended (outside its timer):
    a listener's ``on_step`` still sees no figure; the printed step is DeepSpeed's (global_steps after the step)."""
    engine = _engine({"flops_profiler": {"enabled": True, "profile_step": 0}})
    seen: list[object] = []

    class Watch:
        def on_step(self, report: object) -> None:
            seen.append(engine.flops_profiler.model_flops_per_sample)

    engine.events.subscribe(Watch())
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    engine.backward(engine(tokens, tokens))
    engine.step()
    assert seen == [None] and engine.flops_profiler.model_flops_per_sample is not None
    assert any("Profile Summary at step 1:" in line for line in engine.flops_profiler.summary)


def _train(enabled: bool, recompute: bool) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    import functools

    import torch.nn.modules.module as module_globals
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from shardspeed import checkpointing

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "steps_per_print": 1000,
        "flops_profiler": {"enabled": enabled, "profile_step": 1, "detailed": False},
    }
    model = GPT(GPTConfig(vocab_size=64, context_length=16, n_layer=2, d_model=32, n_head=2, dropout=0.1))
    engine, *_ = shardspeed.initialize(model=model, config=config)
    engine.flops_profiler._print = lambda text: None
    if recompute:
        for block in engine.module.blocks:
            block.forward = functools.partial(checkpointing.checkpoint, block.forward)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(6):
        tokens = torch.randint(0, 64, (2, 16), generator=g)
        loss = engine(tokens, tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert _get_current_dispatch_mode() is None and not module_globals._global_forward_pre_hooks
    assert torch.utils.checkpoint._enable_checkpoint_early_stop is None  # the toggle is undone
    params = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    return losses, params, torch.get_rng_state()


def test_profiling_leaves_training_bit_identical() -> None:
    """Dropout on, with and without activation checkpointing: losses, parameters and the RNG after 3 steps (the
    second one profiled) are those of an unprofiled run, and no counting state is left behind."""
    for recompute in (False, True):
        plain, profiled = _train(False, recompute), _train(True, recompute)
        assert plain[0] == profiled[0]
        assert torch.equal(plain[1], profiled[1]) and torch.equal(plain[2], profiled[2])
