"""``shardspeed data-analyze`` (data/analyzer/): the metrics, DeepSpeed's file layout (compared with DeepSpeed
0.19.8's own DataAnalyzer in a subprocess), worker-count independence, the indexed fast path and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from shardspeed.data.analyzer import analyze, load_metric_index, metric_files, write_metric_files
from shardspeed.data.analyzer.analyze import _indexed_builtin
from shardspeed.data.analyzer.cli import main as cli_main
from shardspeed.data.indexed import IndexedDataset, write_indexed_dataset
from shardspeed.launcher.subcommands import get_subcommand

DS_PYTHON = Path(os.environ.get("SHARDSPEED_DS_PYTHON", "/work/dsvenv/bin/python"))


def _token_samples(n: int = 300, seed: int = 0) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    # Zipf-like ids: a few common tokens, a long tail, so rarity differs between samples.
    return [torch.from_numpy(rng.zipf(1.5, size=int(rng.integers(0, 40))) % 500) for _ in range(n)]


def _read(prefix: Path) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def test_files_have_deepspeeds_layout(tmp_path: Path) -> None:
    values = np.array([5, 3, 5, 9, 3, 3])
    files = write_metric_files(values, tmp_path, "m")
    assert files == metric_files(tmp_path, "m") and files.index_to_sample == tmp_path / "m" / "m_index_to_sample"
    assert _read(files.sample_to_metric) == [[5], [3], [5], [9], [3], [3]]
    assert _read(files.index_to_metric) == [[3], [5], [9]]
    assert _read(files.index_to_sample) == [[1, 4, 5], [0, 2], [3]]
    assert _read(files.index_to_sample_percentile_merged) == [[1, 4, 5], [0, 2], [3]]
    assert IndexedDataset(files.index_to_sample).dtype == np.uint8  # fits len - 1
    index = load_metric_index(files.index_to_sample, files.index_to_metric)
    assert index.samples.tolist() == [1, 4, 5, 0, 2, 3] and index.row_values.tolist() == [3, 5, 9]
    with pytest.raises(ValueError, match="integers"):
        write_metric_files(np.array([0.5]), tmp_path, "f")


def test_seqlen_and_rarity_match_by_hand_and_across_paths(tmp_path: Path) -> None:
    samples = [torch.tensor([1, 1, 2]), torch.tensor([], dtype=torch.long), torch.tensor([3])]
    assert analyze(samples, "seqlen", progress=False).values.tolist() == [3, 0, 1]
    # counts: 1 -> 2, 2 -> 1, 3 -> 1 of 4 tokens
    nl = {1: -np.log(0.5), 2: -np.log(0.25), 3: -np.log(0.25)}
    expected = [round(1000 * (2 * nl[1] + nl[2]) / 3), 0, round(1000 * nl[3])]
    assert analyze(samples, "vocab_rarity", progress=False).values.tolist() == expected
    many = _token_samples()
    write_indexed_dataset(tmp_path / "tok", many, np.uint16)
    for metric in ("seqlen", "vocab_rarity"):
        by_sample = analyze(many, metric, progress=False, chunk_size=37).values
        indexed = analyze(str(tmp_path / "tok"), metric, progress=False).values
        assert np.array_equal(by_sample, indexed), metric
        chunked = _indexed_builtin(IndexedDataset(tmp_path / "tok"), metric, chunk_tokens=50)  # many memmap chunks
        assert np.array_equal(by_sample, chunked), metric


def test_workers_do_not_change_values_and_user_functions_work(tmp_path: Path) -> None:
    many = _token_samples(200, seed=3)
    one = analyze(many, "vocab_rarity", progress=False, chunk_size=16)
    two = analyze(many, "vocab_rarity", num_workers=2, progress=False, chunk_size=16, save_path=tmp_path)
    assert np.array_equal(one.values, two.values)
    assert two.files is not None and len(IndexedDataset(two.files.sample_to_metric)) == 200

    def distinct(sample: torch.Tensor) -> int:
        return len(set(sample.tolist()))

    result = analyze(many, distinct, num_workers=2, progress=False, chunk_size=16)
    assert result.metric_name == "distinct" and result.values.tolist() == [distinct(s) for s in many]
    with pytest.raises(ValueError, match="sample 0"):
        analyze(many, lambda s: 0.5, progress=False)
    with pytest.raises(ValueError, match="neither a built-in"):
        analyze(many, "nonsense", progress=False)
    with pytest.raises(ValueError, match="empty"):
        analyze([], "seqlen", progress=False)


def test_cli_writes_files_and_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert get_subcommand("data-analyze") is not None
    write_indexed_dataset(tmp_path / "tok", _token_samples(50), np.uint16)
    out = tmp_path / "out"
    code = cli_main(["--data", str(tmp_path / "tok"), "--metric", "seqlen", "--save-path", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0 and f"index_to_sample_path: {out / 'seqlen' / 'seqlen_index_to_sample'}" in printed
    assert len(IndexedDataset(out / "seqlen" / "seqlen_sample_to_metric")) == 50
    code = cli_main(
        [
            *("--data", str(tmp_path / "tok"), "--metric", "shardspeed.data.analyzer.metrics:seqlen"),
            *("--metric-name", "len", "--save-path", str(out), "--no-progress"),
        ]
    )
    assert code == 0 and (out / "len" / "len_index_to_metric.idx").is_file()
    code = cli_main(["--data", str(tmp_path / "nope"), "--save-path", str(out), "--no-progress"])
    assert code == 2 and "nope.idx" in capsys.readouterr().err


@pytest.mark.slow  # DeepSpeed's import and its multiprocess reduce: ~10 s on 2 idle cores
def test_same_files_as_deepspeeds_data_analyzer(tmp_path: Path) -> None:
    """DeepSpeed's DataAnalyzer (map + reduce, one worker) and ours, on the same values: same items and dtypes."""
    if not DS_PYTHON.exists():
        pytest.skip(f"DeepSpeed's venv ({DS_PYTHON}) is absent; set SHARDSPEED_DS_PYTHON to run the cross-check")
    rng = np.random.default_rng(5)  # 260 distinct values: percentile_merged merges rows 2 at a time
    values = rng.permutation(np.concatenate((np.arange(260), rng.integers(0, 260, size=140))))
    np.save(tmp_path / "values.npy", values)
    script = (
        "import json, numpy as np\n"
        "from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer\n"
        "values = np.load('values.npy')\n"
        "def metric(batch): return np.array([int(v) for v in batch], dtype=np.int64)\n"
        "a = DataAnalyzer(list(values), batch_size=7, metric_names=['m'], metric_functions=[metric],\n"
        "    metric_types=['single_value_per_sample'], metric_dtypes=[np.int64], save_path='ds',\n"
        "    collate_fn=lambda b: b)\n"
        "a.run_map(); a.run_reduce(); print(json.dumps({'ok': True}))\n"
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    run = subprocess.run([str(DS_PYTHON), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    ours = write_metric_files(values, tmp_path / "ours", "m")
    theirs = metric_files(tmp_path / "ds", "m")
    assert len(IndexedDataset(ours.index_to_sample_percentile_merged)) == 130
    for kind in ("sample_to_metric", "index_to_sample", "index_to_metric", "index_to_sample_percentile_merged"):
        a, b = IndexedDataset(getattr(ours, kind)), IndexedDataset(getattr(theirs, kind))
        assert a.dtype == b.dtype, kind
        assert [a[i].tolist() for i in range(len(a))] == [b[i].tolist() for i in range(len(b))], kind
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"ok": True}
