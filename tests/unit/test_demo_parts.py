"""The demo's parts in isolation: model, corpus, windows, statistics, arguments, outcome reporting."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import pytest
import torch

from shardspeed.config.errors import ConfigError
from shardspeed.demo import __main__ as demo_main
from shardspeed.demo import observe as demo_observe
from shardspeed.demo import train as demo_train
from shardspeed.demo.corpus import (
    FILE_SEPARATOR,
    ByteWindows,
    byte_tokens,
    python_source_files,
    read_corpus,
    train_eval_split,
)
from shardspeed.demo.model import GPT, TINY_CONFIG, GPTConfig
from shardspeed.demo.progress import RunSummary, format_memory, gather_stats, read_memory_mb

SMALL = GPTConfig(context_length=16, n_layer=2, d_model=32, n_head=4)


# ---- model ----------------------------------------------------------------------------------------------
def test_forward_shapes_and_backward_reaches_every_parameter() -> None:
    torch.manual_seed(0)
    model = GPT(SMALL)
    tokens = torch.randint(0, 256, (3, 16))
    assert model(tokens).shape == (3, 16, 256)
    loss = model(tokens, torch.randint(0, 256, (3, 16)))
    assert loss.shape == ()
    loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.shape == parameter.shape, name
        assert torch.isfinite(parameter.grad).all(), name


def test_the_lm_head_is_tied_to_the_token_embedding() -> None:
    model = GPT(SMALL)
    assert model.lm_head.weight is model.token_embedding.weight
    d, v, t, layers = 32, 256, 16, 2
    per_block = (2 * 2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    assert model.num_parameters() == v * d + t * d + layers * per_block + 2 * d


def test_initial_loss_is_near_uniform_over_bytes() -> None:
    torch.manual_seed(0)
    model = GPT(SMALL)
    tokens = torch.randint(0, 256, (8, 16))
    loss = model(tokens, torch.randint(0, 256, (8, 16))).item()
    assert abs(loss - math.log(256)) < 0.1


def test_future_tokens_do_not_change_past_logits() -> None:
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    tokens = torch.randint(0, 256, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 7) % 256
    with torch.no_grad():
        original, altered = model(tokens), model(changed)
    torch.testing.assert_close(original[:, :10], altered[:, :10])
    assert (original[:, 10:] - altered[:, 10:]).abs().max() > 1e-3, "later positions must see the change"


def test_a_sequence_longer_than_the_context_is_rejected() -> None:
    with pytest.raises(ValueError, match="sequence length 17 exceeds the model's context_length 16"):
        GPT(SMALL)(torch.zeros(1, 17, dtype=torch.long))


def test_bad_model_configs_name_the_field() -> None:
    with pytest.raises(ValueError, match="d_model 30 must be divisible by n_head 4"):
        GPTConfig(d_model=30, n_head=4)
    with pytest.raises(ValueError, match=r"GPTConfig\.n_layer must be a positive integer, got 0"):
        GPTConfig(n_layer=0)


# ---- corpus ---------------------------------------------------------------------------------------------
def make_tree(root: Path) -> None:
    files = {
        "b.py": b"bee\n",
        "a.py": b"ay\n",
        "pkg/z.py": b"zed\n",
        "pkg/c.py": b"see\n",
        "notes.txt": b"not python\n",
        "site-packages/third_party.py": b"skip me\n",
        "test/test_a.py": b"skip test\n",
    }
    for relative, content in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)


def test_source_files_are_sorted_python_files_outside_skipped_directories(tmp_path: Path) -> None:
    make_tree(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in python_source_files(tmp_path)] == [
        "a.py",
        "b.py",
        "pkg/c.py",
        "pkg/z.py",
    ]


def test_the_corpus_concatenates_in_order_and_respects_the_cap(tmp_path: Path) -> None:
    make_tree(tmp_path)
    whole = FILE_SEPARATOR.join([b"ay\n", b"bee\n", b"see\n", b"zed\n"]) + FILE_SEPARATOR
    assert read_corpus(10_000, root=tmp_path) == whole
    assert read_corpus(7, root=tmp_path) == whole[:7]


def test_the_stdlib_corpus_is_deterministic_and_python() -> None:
    first, second = read_corpus(200_000), read_corpus(200_000)
    assert first == second and len(first) == 200_000
    assert b"def " in first and b"import " in first


def test_byte_tokens_are_the_byte_values() -> None:
    tokens = byte_tokens(b"\x00A\xff")
    assert tokens.dtype == torch.uint8 and tokens.tolist() == [0, 65, 255]


def test_windows_tile_the_stream_with_targets_shifted_by_one() -> None:
    tokens = torch.arange(23, dtype=torch.uint8)
    windows = ByteWindows(tokens, 5)
    assert len(windows) == 4  # (23 - 1) // 5: the 4th window's last target is token 20
    x, y = windows[1]
    assert x.dtype == torch.long and x.tolist() == [5, 6, 7, 8, 9] and y.tolist() == [6, 7, 8, 9, 10]
    assert windows[3][1].tolist() == [16, 17, 18, 19, 20]
    with pytest.raises(IndexError, match="window 4 out of range for 4 windows"):
        windows[4]


def test_the_held_out_split_is_the_tail_and_never_overlaps() -> None:
    tokens = torch.arange(200, dtype=torch.uint8)
    train, held_out = train_eval_split(tokens, 8, eval_fraction=0.1)
    train_tokens = {t for i in range(len(train)) for t in train[i][0].tolist() + train[i][1].tolist()}
    eval_tokens = {t for i in range(len(held_out)) for t in held_out[i][0].tolist() + held_out[i][1].tolist()}
    assert max(train_tokens) < 180 <= min(eval_tokens)
    assert len(train) == (180 - 1) // 8 and len(held_out) == (20 - 1) // 8


# ---- statistics and summary ------------------------------------------------------------------------
def test_memory_reading_and_formatting() -> None:
    rss, peak = read_memory_mb("VmRSS"), read_memory_mb("VmHWM")
    assert 1 < rss <= peak + 1
    assert format_memory([312.4, 309.0]) == "mem 312/309 MB"


def test_gather_in_a_world_of_one_averages_micro_steps() -> None:
    stats = gather_stats(6.0, 3, 100.0, True, group=None, world_size=1, device=torch.device("cpu"))
    assert stats.mean_loss == 2.0 and stats.memory_mb == [100.0] and stats.stop


def test_summary_verdict_and_table() -> None:
    summary = RunSummary(world_size=2, stage=0, precision="fp32", backend="gloo, cpu", model_description="m")
    summary.first_loss, summary.last_loss, summary.peak_memory_mb = 5.0, 2.5, [300.0, 290.0]
    assert summary.loss_went_down
    table = summary.table()
    assert "5.0000 -> 2.5000" in table and "300/290 MB" in table and "loss went down     yes" in table
    summary.last_loss = math.nan
    assert not summary.loss_went_down


class FakeEngine:
    """Just enough of the engine for ``evaluate``: a world of one that calls the model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.topology = types.SimpleNamespace(dp_rank=0, dp_world_size=1, dp_group=None)
        self.device = torch.device("cpu")
        self.modes: list[bool] = []

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        self.modes.append(self.model.training)
        return self.model(*args)

    def eval(self) -> None:
        self.model.eval()

    def train(self) -> None:
        self.model.train()


def test_evaluate_is_the_mean_batch_loss_in_eval_mode() -> None:
    torch.manual_seed(0)
    model = GPT(SMALL)
    windows = ByteWindows(torch.randint(0, 256, (16 * 10 + 1,), dtype=torch.uint8), 16)
    engine = FakeEngine(model)
    got = demo_train.evaluate(engine, windows, max_windows=9, micro_batch_size=4)  # 9 → 2 batches of 4
    with torch.no_grad():
        expected = [
            model(*[torch.stack(t) for t in zip(*[windows[i] for i in b])]).item() for b in (range(4), range(4, 8))
        ]
    assert got == pytest.approx(sum(expected) / 2, rel=1e-6)
    assert engine.modes == [False, False] and model.training


# ---- arguments, config and outcome reporting ------------------------------------------------------
def test_defaults_and_what_goes_into_the_deepspeed_config() -> None:
    args = demo_main.parse_args(["--stage", "2", "--bf16", "--steps", "50"])
    assert args.nproc == 2 and args.micro_batch == 8 and args.grad_accum == 1
    config = demo_train.deepspeed_config(args)
    assert config["zero_optimization"] == {"stage": 2}
    assert config["bf16"] == {"enabled": True}
    assert config["gradient_clipping"] == 1.0
    assert config["optimizer"]["type"] == "Adam" and config["optimizer"]["params"]["lr"] == args.lr
    assert config["scheduler"]["params"]["total_num_steps"] == 50
    assert config["scheduler"]["params"]["warmup_num_steps"] == 5


def test_tiny_flag_and_size_overrides() -> None:
    assert demo_train.model_config(demo_main.parse_args(["--tiny"])) == TINY_CONFIG
    assert demo_train.model_config(demo_main.parse_args(["--layers", "3"])) == GPTConfig(n_layer=3)


@pytest.mark.parametrize("argv", [["--nproc", "0"], ["--steps", "-1"], ["--lr", "0"], ["--stage"]])
def test_bad_arguments_exit_with_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        demo_main.parse_args(argv)
    assert exit_info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_a_config_error_in_a_worker_is_one_line_and_reported_through_the_result_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def failing_run(args: object) -> int:
        raise ConfigError("zero_optimization.stage: 3 is not implemented yet; valid: 0")

    monkeypatch.setattr(demo_train, "run", failing_run)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(demo_main.ARGV_ENV, raising=False)
    result = tmp_path / "result.json"
    monkeypatch.setenv(demo_main.RESULT_FILE_ENV, str(result))
    assert demo_main.main(["--stage", "3"]) == 0, "the worker itself succeeds so the launcher stays quiet"
    assert json.loads(result.read_text()) == {"exit_code": 2}
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "shardspeed.demo: config error: zero_optimization.stage: 3 is not implemented yet; valid: 0"
    ]
    monkeypatch.delenv(demo_main.RESULT_FILE_ENV)
    assert demo_main.main(["--stage", "3"]) == 2, "under a user's own torchrun the exit code is direct"


def test_relaunch_runs_torch_distributed_run_and_returns_the_workers_verdict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, object] = {}

    class FakeLauncher:
        def __init__(self, command: list[str], env: dict[str, str]) -> None:
            seen["command"], seen["env"] = command, env
            Path(env[demo_main.RESULT_FILE_ENV]).write_text(json.dumps({"exit_code": 1}))

        def wait(self) -> int:
            return 0

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(demo_main.subprocess, "Popen", FakeLauncher)
    assert demo_main.main(["--nproc", "3", "--cpu", "--steps", "5"]) == 1
    command = seen["command"]
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert command[command.index("--nproc_per_node") + 1] == "3"
    assert 0 < int(command[command.index("--master_port") + 1]) < 65536
    assert command[-2:] == ["-m", "shardspeed.demo"], "no script arguments for the launcher to misparse"
    worker_argv = json.loads(seen["env"][demo_main.ARGV_ENV])
    assert worker_argv[:5] == ["--nproc", "3", "--cpu", "--steps", "5"]
    assert worker_argv[5] == "--run-dir" and worker_argv[6].startswith("runs/demo-")  # one directory for all ranks
    assert seen["env"]["OMP_NUM_THREADS"] == "1" and seen["env"]["CUDA_VISIBLE_DEVICES"] == ""


def test_a_relaunched_worker_takes_its_arguments_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    received: list[object] = []
    monkeypatch.setattr(demo_train, "run", lambda args: received.append(args) or 0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(demo_main.ARGV_ENV, json.dumps(["--nproc", "2", "--stage", "1", "--tiny"]))
    monkeypatch.setenv(demo_main.RESULT_FILE_ENV, str(tmp_path / "result.json"))
    assert demo_main.main([]) == 0
    assert received[0].stage == 1 and received[0].tiny and received[0].nproc == 2
    assert json.loads((tmp_path / "result.json").read_text()) == {"exit_code": 0}


# ---- observability: run directory, config sections, MFU row (demo/observe.py) ----------------------
def test_observability_sections_follow_the_config_sections_this_build_has(monkeypatch: pytest.MonkeyPatch) -> None:
    run = Path("runs/x")
    monkeypatch.setattr(demo_observe, "known_sections", lambda: {"zero_optimization"})
    assert demo_observe.observability_sections(run, 100, wandb=True) == {}  # a build without them: none added
    everything = {"tensorboard", "csv_monitor", "wandb", "flops_profiler"}
    monkeypatch.setattr(demo_observe, "known_sections", lambda: everything)
    sections = demo_observe.observability_sections(run, 100, wandb=True)
    assert sections["tensorboard"] == {"enabled": True, "output_path": "runs/x/tensorboard", "job_name": "demo"}
    assert sections["csv_monitor"] == {"enabled": True, "output_path": "runs/x/csv", "job_name": "demo"}
    assert sections["wandb"]["enabled"] and sections["wandb"]["group"] == "x"
    profiler = sections["flops_profiler"]
    assert (
        profiler["enabled"] and profiler["profile_step"] == 2 and profiler["output_file"] == "runs/x/flops_profile.txt"
    )
    assert demo_observe.observability_sections(run, 1)["flops_profiler"]["profile_step"] == 0  # a 1-step run
    assert "wandb" not in demo_observe.observability_sections(run, 100)


def test_the_run_dir_is_written_with_the_config_and_chosen_once_by_the_relauncher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    demo_observe.prepare_run_dir(tmp_path / "run", {"a": 1}, is_rank0=True, wandb=False)
    assert json.loads((tmp_path / "run" / "ds_config.json").read_text()) == {"a": 1}
    first = demo_observe.default_run_dir(0.0, tmp_path / "runs")
    assert first == tmp_path / "runs/demo-19700101-000000" and first.is_dir()
    assert demo_observe.default_run_dir(0.0, tmp_path / "runs") == tmp_path / "runs/demo-19700101-000000-2"
    monkeypatch.chdir(tmp_path)  # the relauncher below claims runs/demo-<now> in the current directory
    assert demo_observe.agree_run_dir("given", None) == Path("given")
    seen = {}
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(demo_main, "relaunch", lambda args, argv: seen.update(args=args, argv=argv) or 0)
    assert demo_main.main(["--steps", "3"]) == 0
    assert seen["argv"][-2] == "--run-dir" and seen["argv"][-1] == seen["args"].run_dir
    assert seen["args"].run_dir.startswith("runs/demo-")


def test_the_mfu_row_uses_the_profilers_figures_or_says_why_there_is_none() -> None:
    assert "no flops profiler" in demo_observe.mfu_line(types.SimpleNamespace(), 10.0, 2)
    idle = types.SimpleNamespace(flops_profiler=types.SimpleNamespace(model_flops_per_sample=None))
    assert "did not run" in demo_observe.mfu_line(idle, 10.0, 2)
    pytest.importorskip("shardspeed.profiling.mfu")  # helper F's module (S5)
    profiled = types.SimpleNamespace(
        flops_profiler=types.SimpleNamespace(model_flops_per_sample=1e9, peak_flops=1e12, peak_source="table: X")
    )
    line = demo_observe.mfu_line(profiled, 100.0, 2)  # 1e11 FLOP/s achieved over 2 × 1e12
    assert line.startswith("5.00% (1 GFLOP/sample × 100.0 samples/s")
    assert "2 device(s) × 1 TFLOP/s peak: table: X" in line


def test_a_report_that_fails_is_a_line_not_a_crash(tmp_path: Path) -> None:
    job = tmp_path / "run" / "csv" / "demo"
    job.mkdir(parents=True)
    (job / "Train_Samples_lr.csv").write_bytes(b"step,lr\n" + b"8,0.1\n" * 3000 + b"\xff\xfe")  # UnicodeDecodeError
    line = demo_observe.write_run_report(tmp_path / "run")
    assert line.startswith("report: not written (UnicodeDecodeError")


def test_the_report_line_names_the_run_dir_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo-x").mkdir(parents=True)
    line = demo_observe.write_run_report(Path("runs/demo-x"))
    assert line.startswith("report: runs/demo-x/report/index.html  (open it"), line
