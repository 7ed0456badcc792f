"""The flops profiler (shardspeed/profiling/): FLOPs of known modules equal their formulas, the demo GPT's
forward + backward total equals 6·T·W + 12·L·s·d·T exactly, DeepSpeed's API and summary lines, and
``engine.flops_profiler`` profiles exactly the step ``profile_step``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from shardspeed.demo.model import GPT, GPTConfig
from shardspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile
from shardspeed.profiling.session import ProfileSession, WindowFigures

CFG = GPTConfig(vocab_size=64, context_length=16, n_layer=2, d_model=32, n_head=2)


def profile(module: nn.Module, run_forward, backward: bool = True) -> WindowFigures:
    """One forward (and backward) phase of ``module`` under a session."""
    session = ProfileSession(module)
    session.start()
    session.begin_phase("forward")
    out = run_forward()
    session.end_phase("forward")
    if backward:
        session.begin_phase("backward")
        out.sum().backward()
        session.end_phase("backward")
    session.stop()
    return session.figures()


def gpt_formula(model: GPT, tokens: int, seq: int) -> int:
    """6·T·W + 12·L·s·d·T: W = matmul weight elements (the tied head once, the position table is a lookup)."""
    cfg = model.config
    weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "position" not in n)
    return 6 * tokens * weights + 12 * cfg.n_layer * seq * cfg.d_model * tokens


def test_linear_is_2mnk_forward_and_twice_that_backward() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(24, 40)
    x = torch.randn(3, 5, 24, requires_grad=True)
    fig = profile(linear, lambda: linear(x))
    m, k, n = 15, 24, 40
    assert fig.flops("forward") == 2 * m * k * n
    assert fig.flops("backward") == 2 * (2 * m * k * n)  # grad of the input and of the weight
    assert fig.modules[0].params == 24 * 40 + 40
    assert fig.modules[0].macs == m * k * n


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_sdpa_counts_the_full_score_matrix(causal: bool) -> None:
    """[Note: the causal rule]: a causal mask counts the full s² (so causal == non-causal); backward = 2× forward."""
    b, h, s, dh = 2, 3, 10, 8
    q, k, v = (torch.randn(b, h, s, dh, requires_grad=True) for _ in range(3))
    holder = nn.Module()
    fig = profile(holder, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    assert fig.flops("forward") == 4 * b * h * s * s * dh
    assert fig.flops("backward") == 8 * b * h * s * s * dh


def test_embedding_and_layernorm_count_zero() -> None:
    """Only ops with a formula count (FlopCounterMode): a lookup and a norm are 0 FLOPs."""
    emb, norm = nn.Embedding(50, 16), nn.LayerNorm(16)
    ids = torch.randint(0, 50, (4, 7))
    assert profile(emb, lambda: emb(ids)).flops("forward") == 0
    x = torch.randn(4, 7, 16, requires_grad=True)
    fig = profile(norm, lambda: norm(x))
    assert (fig.flops("forward"), fig.flops("backward")) == (0, 0)


def test_demo_gpt_forward_plus_backward_is_6TW_plus_12LsdT() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    batch, seq = 3, 16
    tokens = torch.randint(0, CFG.vocab_size, (batch, seq))
    fig = profile(model, lambda: model(tokens, tokens))
    total = fig.flops("forward") + fig.flops("backward")
    assert total == gpt_formula(model, batch * seq, seq)
    assert fig.flops("backward") == 2 * fig.flops("forward")
    assert fig.params == model.num_parameters()  # the tied matrix once
    # attribution: every block's linears carry their 2·m·k·n (qkv: d → 3d)
    qkv = next(s for s in fig.modules if s.path == "blocks.0.attn.qkv")
    assert qkv.fwd_flops == 2 * batch * seq * CFG.d_model * 3 * CFG.d_model


def test_recompute_is_counted_apart() -> None:
    """A module forward inside the backward phase (activation checkpointing) is recompute, summed apart."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)

    model = Checkpointed()
    x = torch.randn(4, 8, requires_grad=True)
    fig = profile(model, lambda: model(x))
    forward = 2 * (2 * 4 * 8 * 8)
    assert fig.flops("forward") == forward
    assert fig.recompute_flops == forward  # recomputed whole while profiling ([Note: measuring recompute])
    assert fig.flops("backward") == 2 * forward + forward
    assert torch.utils.checkpoint._enable_checkpoint_early_stop is None  # put back


def test_get_model_profile_matches_the_session() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    flops, macs, params = get_model_profile(model, args=[tokens], print_profile=False, as_string=False)
    with torch.no_grad():
        fig = profile(model, lambda: model(tokens), backward=False)
    assert (flops, macs, params) == (fig.flops("forward"), fig.flops("forward") // 2, model.num_parameters())
    assert (
        flops
        == 2 * 2 * 16 * sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "pos" not in n)
        + 4 * CFG.n_layer * 16 * CFG.d_model * 32
    )
    as_text = get_model_profile(model, args=[tokens], print_profile=False)
    assert all(isinstance(v, str) for v in as_text)
    linear = nn.Linear(6, 10)
    assert get_model_profile(linear, input_shape=(4, 6), print_profile=False, as_string=False) == (480, 240, 70)


def test_get_model_profile_bad_input_names_it() -> None:
    with pytest.raises(ValueError, match="input_shape"):
        get_model_profile(nn.Linear(2, 2), input_shape=[2, 2], print_profile=False)
    with pytest.raises(ValueError, match="args"):
        get_model_profile(nn.Linear(2, 2), print_profile=False)


def test_flops_profiler_api_writes_deepspeeds_lines(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    prof = FlopsProfiler(model)
    prof.start_profile()
    loss = model(tokens, tokens)
    prof.stop_profile()
    loss.backward()  # outside the window: not counted
    out = tmp_path / "sub" / "profile.txt"
    prof.print_model_profile(profile_step=1, module_depth=-1, top_modules=2, detailed=True, output_file=str(out))
    flops, params = prof.get_total_flops(), prof.get_total_params()
    prof.end_profile()
    text = out.read_text()
    for line in (
        "-------------------------- DeepSpeed Flops Profiler --------------------------",
        "Profile Summary at step 1:",
        "params per GPU: ",
        "fwd MACs per GPU: ",
        "fwd flops per GPU: ",
        "fwd latency: ",
        "fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
        "Top 2 modules in terms of params, MACs or fwd latency at different model depths:",
        "depth 0:",
        "------------------------------ Detailed Profile per GPU ------------------------------",
        "(qkv): Linear(",
    ):
        assert line in text, line
    assert flops == gpt_formula(model, 32, 16) // 3 and params == model.num_parameters()
    assert prof.get_total_flops() == 0 and not prof.started  # end_profile forgets


def _engine(extra: dict) -> shardspeed.ShardSpeedEngine:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        **extra,
    }
    engine, *_ = shardspeed.initialize(model=GPT(CFG), config=config)
    return engine


def test_engine_profiles_exactly_profile_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "flops_profile.txt"
    engine = _engine(
        {"flops_profiler": {"enabled": True, "profile_step": 2, "top_modules": 2, "output_file": str(out)}}
    )
    profiler = engine.flops_profiler
    g = torch.Generator().manual_seed(1)
    seen: list[tuple[int, float | None]] = []
    for _step in range(4):
        for _micro in range(2):  # DeepSpeed's loop: step() after every micro-batch; the boundary one steps
            tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=g)
            engine.backward(engine(tokens, tokens))
            engine.step()
        seen.append((engine.global_steps, profiler.model_flops_per_sample))
    assert [s for s, f in seen if f is None] == [1, 2]  # profiled the step after 2 steps, once
    assert profiler.state == "DONE" and profiler.figures is not None
    fig = profiler.figures
    assert (fig.phases["forward"].count, fig.phases["backward"].count, fig.phases["step"].count) == (2, 2, 1)
    per_sample = gpt_formula(engine.module, 16, 16)  # one sample = 16 tokens
    assert profiler.model_flops_per_sample == per_sample
    assert fig.flops("forward") + fig.flops("backward") == 4 * per_sample  # GAS 2 × micro 2
    assert profiler.model_params == engine.module.num_parameters()
    assert profiler.peak_flops > 0 and profiler.peak_source.startswith("measured: ")
    text = out.read_text()
    for line in ("Profile Summary at step 2:", "world size: ", "bwd latency: ", "samples/second: ", "MFU = "):
        assert line in text, line
    assert "Profile Summary at step 2:" in capsys.readouterr().out


def test_engine_profiler_is_inactive_by_default() -> None:
    engine = _engine({})
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    for _ in range(8):
        engine.backward(engine(tokens, tokens))
        engine.step()
    assert engine.global_steps == 4
    assert engine.flops_profiler.state == "DONE" and engine.flops_profiler.model_flops_per_sample is None


def test_engine_model_flops_leave_out_activation_recompute() -> None:
    """Blocks recomputed in backward (shardspeed.checkpointing): the recompute is measured apart and the model
    FLOPs per sample stay 6·T·W + 12·L·s·d·T."""
    import functools

    from shardspeed import checkpointing

    engine = _engine({"flops_profiler": {"enabled": True, "profile_step": 0}})
    for block in engine.module.blocks:
        block.forward = functools.partial(checkpointing.checkpoint, block.forward)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    for _ in range(2):
        engine.backward(engine(tokens, tokens))
        engine.step()
    profiler = engine.flops_profiler
    fig = profiler.figures
    blocks_forward = sum(s.fwd_flops for s in fig.modules if s.path in ("blocks.0", "blocks.1"))
    assert blocks_forward > 0 and fig.recompute_flops == blocks_forward
    assert fig.flops("backward") == 2 * fig.flops("forward") + blocks_forward
    assert profiler.model_flops_per_sample == gpt_formula(engine.module, 16, 16)


def test_unwritable_output_file_warns_and_training_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    engine = _engine({"flops_profiler": {"enabled": True, "profile_step": 0, "output_file": str(blocker / "x.txt")}})
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    with caplog.at_level("WARNING"):
        for _ in range(4):
            engine.backward(engine(tokens, tokens))
            engine.step()
    assert engine.global_steps == 2 and engine.flops_profiler.model_flops_per_sample is not None
    assert "could not be written" in caplog.text


def test_backward_latency_per_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    x = torch.randn(32, 64, requires_grad=True)
    fig = profile(model, lambda: model(x))
    root, first, _relu, last = fig.modules
    assert first.bwd_latency > 0 and last.bwd_latency > 0
    assert root.bwd_latency == fig.seconds("backward")
    with torch.no_grad():  # no graph, no backward timing hooks
        assert profile(model, lambda: model(x), backward=False).modules[1].bwd_latency == 0


def test_signatures_are_deepspeeds() -> None:
    """Parameter names and defaults of DeepSpeed 0.19.8's profiling/flops_profiler/profiler.py."""
    import inspect

    def params(fn) -> list[tuple[str, object]]:
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]

    assert params(get_model_profile) == [
        ("model", inspect.Parameter.empty), ("input_shape", None), ("args", []), ("kwargs", {}),
        ("print_profile", True), ("detailed", True), ("module_depth", -1), ("top_modules", 1), ("warm_up", 1),
        ("as_string", True), ("output_file", None), ("ignore_modules", None), ("mode", "forward"),
    ]  # fmt: skip
    assert params(FlopsProfiler.__init__) == [
        ("self", inspect.Parameter.empty), ("model", inspect.Parameter.empty), ("ds_engine", None),
        ("recompute_fwd_factor", 0.0),
    ]  # fmt: skip
    assert params(FlopsProfiler.print_model_profile)[1:] == [
        ("profile_step", 1), ("module_depth", -1), ("top_modules", 1), ("detailed", True), ("output_file", None),
    ]  # fmt: skip
    assert params(FlopsProfiler.start_profile)[1:] == [("ignore_list", None)]
    for name in ("get_total_flops", "get_total_macs", "get_total_params", "get_total_duration"):
        assert params(getattr(FlopsProfiler, name))[1:] == [("as_string", False)]
    assert all(callable(getattr(FlopsProfiler, n)) for n in ("stop_profile", "end_profile", "reset_profile"))
