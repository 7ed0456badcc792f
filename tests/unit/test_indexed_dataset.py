"""DeepSpeed's memory-mapped indexed dataset format (data/indexed/): pure round trips, bad files, and both
directions against DeepSpeed 0.19.8's own ``MMapIndexedDataset`` / ``MMapIndexedDatasetBuilder`` (run in a
subprocess from /work/dsvenv; skipped with a reason where that venv is absent)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from shardspeed.data.indexed import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedFormatError,
    dtype_code,
    fit_int_dtype,
    write_flat,
    write_indexed_dataset,
)
from shardspeed.data.indexed.format import encode_index

DS_PYTHON = Path(os.environ.get("SHARDSPEED_DS_PYTHON", "/work/dsvenv/bin/python"))


def _items(seed: int = 0, n: int = 20) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 30000, size=int(rng.integers(0, 9))) for _ in range(n)]


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16, np.uint32, np.uint64])
def test_round_trip_every_dtype(tmp_path: Path, dtype: type) -> None:
    items = [np.arange(k, dtype=dtype) for k in (3, 0, 5, 1)]
    write_indexed_dataset(tmp_path / "d", items, dtype)
    ds = IndexedDataset(tmp_path / "d")
    assert len(ds) == 4 and ds.dtype == np.dtype(dtype)
    for got, want in zip([ds[i] for i in range(4)], items, strict=True):
        assert got.dtype == np.dtype(dtype) and np.array_equal(got, want)
    assert ds.doc_idx.tolist() == [0, 4]
    assert ds.sizes.tolist() == [3, 0, 5, 1]
    assert ds[-1].tolist() == [0]


def test_flat_write_equals_item_by_item(tmp_path: Path) -> None:
    items = _items()
    write_indexed_dataset(tmp_path / "a", [torch.from_numpy(x) for x in items], np.uint16)
    write_flat(tmp_path / "b", np.concatenate(items), np.array([len(x) for x in items]), np.uint16)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"a{suffix}").read_bytes() == (tmp_path / f"b{suffix}").read_bytes()


def test_bad_inputs_are_named(tmp_path: Path) -> None:
    with pytest.raises(IndexedFormatError, match="float32"):
        dtype_code(np.float32)
    assert dtype_code(torch.int64) == 5 and dtype_code(np.uint16) == 6
    with pytest.raises(ValueError, match="do not fit uint8"):
        write_indexed_dataset(tmp_path / "x", [np.array([300])], np.uint8)
    with pytest.raises(FileNotFoundError, match=r"missing\.idx"):
        IndexedDataset(tmp_path / "missing")
    write_indexed_dataset(tmp_path / "t", _items(), np.int32)
    raw = (tmp_path / "t.idx").read_bytes()
    (tmp_path / "t.idx").write_bytes(raw[:-3])
    with pytest.raises(IndexedFormatError, match="truncated"):
        IndexedDataset(tmp_path / "t")
    (tmp_path / "t.idx").write_bytes(b"TNTIDX\x00\x00" + raw[8:])
    with pytest.raises(IndexedFormatError, match="magic"):
        IndexedDataset(tmp_path / "t")
    (tmp_path / "t.idx").write_bytes(raw)
    (tmp_path / "t.bin").write_bytes((tmp_path / "t.bin").read_bytes()[:-4])
    with pytest.raises(IndexedFormatError, match="truncated"):
        IndexedDataset(tmp_path / "t")


def test_fit_int_dtype_is_deepspeeds() -> None:
    assert fit_int_dtype(0, 255) == np.uint8 and fit_int_dtype(0, 256) == np.uint16
    assert fit_int_dtype(0, 2**32) == np.uint64 and fit_int_dtype(-1, 127) == np.int8
    assert fit_int_dtype(-129, 0) == np.int16 and fit_int_dtype(-(2**40), 0) == np.int64


def test_index_layout_is_the_documented_one() -> None:
    raw = encode_index(np.dtype(np.int32), np.array([2, 3]), np.array([0, 2]))
    assert raw[:9] == b"MMIDIDX\x00\x00" and raw[9:17] == (1).to_bytes(8, "little") and raw[17] == 4
    assert np.frombuffer(raw[34 + 8 : 34 + 8 + 16], dtype="<i8").tolist() == [0, 8]  # pointers: bytes


def _deepspeed(script: str, tmp_path: Path) -> dict:
    if not DS_PYTHON.exists():
        pytest.skip(f"DeepSpeed's venv ({DS_PYTHON}) is absent; set SHARDSPEED_DS_PYTHON to run the cross-checks")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    out = subprocess.run(
        [str(DS_PYTHON), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_DS_IMPORT = "from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import "


def test_deepspeed_reads_ours_and_we_read_deepspeeds(tmp_path: Path) -> None:
    """One DeepSpeed subprocess for both directions (its import costs seconds)."""
    items = _items(1)
    write_indexed_dataset(tmp_path / "ours", items, np.uint16)
    script = (
        f"import json, numpy as np, torch\n{_DS_IMPORT}MMapIndexedDataset, MMapIndexedDatasetBuilder\n"
        "ds = MMapIndexedDataset('ours', skip_warmup=True)\n"
        "got = [ds[i].tolist() for i in range(len(ds))]\n"
        "b = MMapIndexedDatasetBuilder('theirs.bin', dtype=np.int64)\n"
        "for i in range(7): b.add_item(torch.arange(i, dtype=torch.long) * 1000)\n"
        "b.end_document(); b.add_item(torch.tensor([-5])); b.end_document(); b.finalize('theirs.idx')\n"
        "print(json.dumps({'items': got, 'dtype': str(ds.dtype.__name__), 'doc_idx': ds.doc_idx.tolist()}))\n"
    )
    seen = _deepspeed(script, tmp_path)
    assert seen["items"] == [x.tolist() for x in items]
    assert seen["dtype"] == "uint16" and seen["doc_idx"] == [0, len(items)]
    theirs = IndexedDataset(tmp_path / "theirs")
    assert [theirs[i].tolist() for i in range(len(theirs))] == [list(range(0, i * 1000, 1000)) for i in range(7)] + [
        [-5]
    ]
    assert theirs.dtype == np.int64 and theirs.doc_idx.tolist() == [0, 7, 8]
    # Byte for byte: DeepSpeed's builder and ours write the same files for the same items.
    builder = IndexedDatasetBuilder(tmp_path / "mine", np.int64)
    for i in range(7):
        builder.add_item(torch.arange(i, dtype=torch.long) * 1000)
    builder.end_document()
    builder.add_item(torch.tensor([-5]))
    builder.end_document()
    builder.finalize()
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"mine{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes()
