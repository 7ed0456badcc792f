"""``shardspeed report``: a run directory built by hand in the monitors' layouts (CSV only; TensorBoard only, written
with torch's SummaryWriter) gives the four plots with data and a page that embeds them with the config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardspeed.launcher.cli import main as launcher_main
from shardspeed.report import read_run, write_report
from shardspeed.report.plots import MEMORY_KINDS, figure, plot_specs
from shardspeed.report.scalars import tag_from_csv

STEPS = 6
CONFIG = {"train_micro_batch_size_per_gpu": 4, "csv_monitor": {"enabled": True, "output_path": "x"}}


def _points(tag: str) -> list[tuple[int, float]]:
    """Deterministic values per tag: x = global samples (8 per step)."""
    base = {"train_loss": 5.0, "lr": 1e-3, "samples_per_second": 100.0, "tokens_per_second": 6400.0}
    name = tag.rsplit("/", 1)[1]
    if tag.startswith("Memory/"):
        rank = int(tag.split("/")[1].removeprefix("rank"))
        value = (2 if "predicted" in name else 300) * 2**20 * (1 + rank)
        return [(8 * (s + 1), float(value + s * 2**20)) for s in range(STEPS)]
    return [(8 * (s + 1), base[name] * (1 - 0.1 * s)) for s in range(STEPS)]


TAGS = [
    "Train/Samples/train_loss",
    "Train/Samples/lr",
    "Train/Samples/samples_per_second",
    "Train/Samples/tokens_per_second",
    *(
        f"Memory/rank{r}/{k}"
        for r in (0, 1)
        for k in ("host_peak_bytes", "model_state_bytes", "predicted_model_state_bytes")
    ),
]


def _common(run: Path) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "ds_config.json").write_text(json.dumps(CONFIG))
    (run / "flops_profile.txt").write_text("fwd MACs per GPU: 1.23 GMACs\nsamples/second: 42.0\n")


def _csv_run(run: Path, tags: list[str] = TAGS) -> Path:
    _common(run)
    job = run / "csv" / "DeepSpeedJobName"
    job.mkdir(parents=True)
    for tag in tags:
        rows = [f"step,{tag.rsplit('/', 1)[1]}", *(f"{x},{v!r}" for x, v in _points(tag))]
        (job / f"{tag.replace('/', '_').replace(' ', '_')}.csv").write_text("\n".join(rows) + "\n")
    return run


def _tensorboard_run(run: Path) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    _common(run)
    writer = SummaryWriter(log_dir=str(run / "tb" / "DeepSpeedJobName"))
    for tag in TAGS:
        for x, value in _points(tag):
            writer.add_scalar(tag, value, x)
    writer.close()
    return run


def _check_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(str(path))
    assert pixels.ndim == 3 and pixels.shape[0] > 100
    assert (pixels != pixels[0, 0]).any()  # not a single colour
    assert len({tuple(p) for p in pixels.reshape(-1, pixels.shape[2])[::97].tolist()}) > 3  # lines, text


@pytest.mark.parametrize("layout", ["csv", "tensorboard"])
def test_report_draws_every_plot_with_its_series_and_a_page_with_the_config(tmp_path: Path, layout: str) -> None:
    run = (_csv_run if layout == "csv" else _tensorboard_run)(tmp_path / "run")
    data = read_run(run)
    assert data.source == layout
    for tag in TAGS:  # TensorBoard stores float32
        assert [x for x, _ in data.scalars[tag]] == [x for x, _ in _points(tag)]
        assert [v for _, v in data.scalars[tag]] == pytest.approx([v for _, v in _points(tag)], rel=1e-7)
    index = write_report(run)
    out = run / "report"
    assert index == out / "index.html"
    for name in ("loss", "lr", "throughput", "memory"):
        _check_png(out / f"{name}.png")
    specs = {spec.name: spec for spec in plot_specs(data.scalars)}
    lengths = {name: [len(line.xs) for panel in spec.panels for line in panel.lines] for name, spec in specs.items()}
    assert lengths == {"loss": [STEPS], "lr": [STEPS], "throughput": [STEPS, STEPS], "memory": [STEPS] * 6}
    drawn = [len(line.get_xdata()) for axes in figure(specs["memory"]).axes for line in axes.get_lines()]
    assert drawn == [STEPS] * 6  # measured and predicted model states, host peak: two ranks
    page = index.read_text()
    for name in ("loss", "lr", "throughput", "memory"):
        assert f'src="{name}.png"' in page
    assert json.dumps(CONFIG, indent=2).replace('"', "&quot;") in page  # the config, pretty-printed
    assert "fwd MACs per GPU: 1.23 GMACs" in page
    assert "Memory/rank1/device_peak_bytes" in page  # CPU run: no device peaks, said on the page


def test_missing_tags_are_said_on_the_page_and_their_plots_are_not_written(tmp_path: Path) -> None:
    run = _csv_run(tmp_path / "run", ["Train/Samples/train_loss"])
    (run / "ds_config.json").unlink()
    index = write_report(run, tmp_path / "elsewhere")
    out = tmp_path / "elsewhere"
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "loss.png"]
    page = index.read_text()
    assert 'src="loss.png"' in page and 'src="lr.png"' not in page
    for tag in ("Train/Samples/lr", "Train/Samples/samples_per_second", "Train/Samples/tokens_per_second"):
        assert tag in page
    assert "No ds_config.json was found" in page


def test_an_empty_run_gives_a_page_not_an_exception(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    page = write_report(tmp_path / "run").read_text()
    assert "no CSV or TensorBoard files were found" in page
    assert not list((tmp_path / "run" / "report").glob("*.png"))


def test_csv_tags_are_rebuilt_from_file_name_and_header_and_repeated_headers_skipped(tmp_path: Path) -> None:
    assert tag_from_csv("Train_Samples_train_loss", "train_loss") == "Train/Samples/train_loss"
    assert tag_from_csv("Memory_rank12_host_peak_bytes", "host_peak_bytes") == "Memory/rank12/host_peak_bytes"
    assert tag_from_csv("loss", "loss") == "loss"
    job = tmp_path / "run" / "job"
    job.mkdir(parents=True)
    (job / "Train_Samples_lr.csv").write_text("step,lr\n8,0.1\nstep,lr\n16,0.2\n")  # appended by a restarted run
    assert read_run(tmp_path / "run").scalars == {"Train/Samples/lr": [(8, 0.1), (16, 0.2)]}


def test_launcher_subcommand_writes_the_report_or_names_the_missing_directory(tmp_path: Path, capsys) -> None:
    run = _csv_run(tmp_path / "run", ["Train/Samples/train_loss"])
    assert launcher_main(["report", str(run), "--out", str(tmp_path / "out")]) == 0
    assert f"wrote {tmp_path / 'out' / 'index.html'}" in capsys.readouterr().out
    assert launcher_main(["report", str(tmp_path / "nope")]) == 2
    assert "run directory" in capsys.readouterr().err


def test_missing_packages_are_one_error_naming_the_monitor_extra(tmp_path: Path, monkeypatch) -> None:
    import sys

    csv_run = _csv_run(tmp_path / "csv", ["Train/Samples/train_loss"])
    tb_run = _tensorboard_run(tmp_path / "tb")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib → ImportError
    with pytest.raises(RuntimeError, match=r"matplotlib.*shardspeed\[monitor\]"):
        write_report(csv_run)
    monkeypatch.setitem(sys.modules, "tensorboard.backend.event_processing.event_accumulator", None)
    with pytest.raises(RuntimeError, match=r"needs tensorboard.*shardspeed\[monitor\]"):
        read_run(tb_run)
    assert launcher_main(["report", str(tb_run)]) == 2


def test_a_stray_csv_does_not_hide_the_tensorboard_logs(tmp_path: Path) -> None:
    run = _tensorboard_run(tmp_path / "run")
    (run / "eval_results.csv").write_text("id,score\n1,0.5\n")  # a user's CSV: not csv_monitor's `step,<name>`
    data = read_run(run)
    assert data.source == "tensorboard" and set(TAGS) <= set(data.scalars)


@pytest.mark.parametrize("where", ["run", "parent"])
def test_an_out_dir_containing_the_run_still_reads_its_files(tmp_path: Path, where: str) -> None:
    run = _csv_run(tmp_path / "run", ["Train/Samples/train_loss"])
    index = write_report(run, run if where == "run" else tmp_path)  # `shardspeed report RUN --out RUN` (or above)
    page = index.read_text()
    assert "No ds_config.json was found" not in page and 'src="loss.png"' in page


def test_a_rerun_into_the_same_csv_keeps_the_last_value_per_x(tmp_path: Path) -> None:
    job = tmp_path / "run" / "job"
    job.mkdir(parents=True)
    (job / "Train_Samples_lr.csv").write_text("step,lr\n8,0.1\n16,0.2\nstep,lr\n8,0.3\n16,0.4\n")
    assert read_run(tmp_path / "run").scalars == {"Train/Samples/lr": [(8, 0.3), (16, 0.4)]}


def test_the_memory_plot_compares_model_states_in_one_colour_per_rank() -> None:
    scalars = {f"Memory/rank{r}/{k}": _points(f"Memory/rank{r}/{k}") for r in (0, 1) for k in MEMORY_KINDS}
    spec = next(s for s in plot_specs(scalars) if s.name == "memory")
    lines = [(line.get_label(), line.get_color(), line.get_linestyle()) for line in figure(spec).axes[0].get_lines()]
    assert [label for label, *_ in lines] == [
        f"rank {r} {k.removesuffix('_bytes')}" for r in (0, 1) for k in MEMORY_KINDS
    ]
    colours = [{c for label, c, _ in lines if label.startswith(f"rank {r} ")} for r in (0, 1)]
    assert all(len(c) == 1 for c in colours) and colours[0] != colours[1]
    assert [style for *_, style in lines[:4]] == ["-", ":", "--", "-."]  # peaks dashed: context
