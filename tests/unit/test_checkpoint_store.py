"""Checkpoint storage: writer/reader round trips over fake ranks, ranged reads, tiling checks, corruption
detection, tag resolution and crash safety of the commit."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from shardspeed.checkpoint import commit as commit_module
from shardspeed.checkpoint import store as store_module
from shardspeed.checkpoint.commit import (
    cleanup_stale_tmp,
    commit_checkpoint,
    list_tags,
    make_tmp_dir,
    read_latest,
    resolve_tag,
)
from shardspeed.checkpoint.index import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTilingError,
)
from shardspeed.checkpoint.store import CheckpointReader, CheckpointWriter

REPO_SRC = Path(__file__).resolve().parents[2] / "src"


def save_pieces(
    save_dir: Path,
    tag: str,
    tensors: dict[str, torch.Tensor],
    *,
    num_ranks: int = 3,
    seed: int = 0,
    chunk_bytes: int = 64,
    file_bytes: int = 256,
    metadata: dict | None = None,
    save_latest: bool = True,
) -> Path:
    """Save ``tensors`` as ``num_ranks`` fake ranks would: each tensor cut at random points, pieces dealt to
    random ranks, one writer per rank, then one commit."""
    rng = random.Random(seed)
    tmp_dir = make_tmp_dir(save_dir, tag, f"nonce{seed}")
    writers = [CheckpointWriter(tmp_dir, rank, chunk_bytes, file_bytes) for rank in range(num_ranks)]
    for name, tensor in tensors.items():
        flat = tensor.reshape(-1)
        cuts = sorted({0, flat.numel(), *(rng.randrange(flat.numel() + 1) for _ in range(rng.randrange(4)))})
        for start, end in itertools.pairwise(cuts):
            writers[rng.randrange(num_ranks)].add(name, tuple(tensor.shape), start, flat[start:end])
    records = [record for writer in writers for record in writer.finish()]
    return commit_checkpoint(save_dir, tag, tmp_dir, records, metadata or {}, save_latest)


def sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "param/blocks.0.weight": torch.randn(7, 13, generator=generator),
        "param/blocks.0.bias": torch.randn(13, generator=generator),
        "optim/blocks.0.weight/exp_avg": torch.randn(7, 13, generator=generator).to(torch.bfloat16),
        "param/half": torch.randn(5, 3, 2, generator=generator).to(torch.float16),
        "buffer/count": torch.tensor(41, dtype=torch.int64),
        "buffer/mask": torch.rand(17, generator=generator) > 0.5,
        "param/f64": torch.randn(9, generator=generator, dtype=torch.float64),
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("chunk_bytes", "file_bytes"), [(64, 256), (8, 40), (1 << 20, 1 << 30)])
def test_round_trip_with_random_pieces_over_fake_ranks(
    tmp_path: Path, seed: int, chunk_bytes: int, file_bytes: int
) -> None:
    tensors = sample_tensors(seed)
    path = save_pieces(tmp_path, "step1", tensors, seed=seed, chunk_bytes=chunk_bytes, file_bytes=file_bytes)
    assert path == tmp_path / "step1"
    ranges = random.Random(seed)
    with CheckpointReader(path) as reader:
        assert sorted(reader.names()) == sorted(tensors)
        for name, tensor in tensors.items():
            assert reader.shape(name) == tuple(tensor.shape)
            assert reader.dtype(name) == tensor.dtype
            assert torch.equal(reader.read_full(name), tensor), name
            flat = tensor.reshape(-1)
            for _ in range(5):
                start = ranges.randrange(flat.numel() + 1)
                end = ranges.randrange(start, flat.numel() + 1)
                assert torch.equal(reader.read_range(name, start, end), flat[start:end])
        converted = reader.read_full("optim/blocks.0.weight/exp_avg", dtype=torch.float32)
        assert converted.dtype == torch.float32
        assert torch.equal(converted, tensors["optim/blocks.0.weight/exp_avg"].float())
        out = torch.zeros(20, dtype=torch.float64)
        reader.read_range_into("param/blocks.0.bias", 0, out[3:16])
        assert torch.equal(out[3:16], tensors["param/blocks.0.bias"].double())
        assert out[:3].eq(0).all() and out[16:].eq(0).all()


def test_chunk_and_file_sizes_and_safetensors_interop(tmp_path: Path) -> None:
    tensor = torch.arange(1000, dtype=torch.float32)
    tmp_dir = make_tmp_dir(tmp_path, "t", "n")
    writer = CheckpointWriter(tmp_dir, 7, chunk_bytes=400, file_bytes=800)
    writer.add("param/w", (10, 100), 0, tensor)
    records = writer.finish()
    # 100 elements per chunk, 2 chunks per file: 10 chunks in 5 files named by rank 7.
    assert [(r["start"], r["end"]) for r in records] == [(i * 100, i * 100 + 100) for i in range(10)]
    assert sorted({r["file"] for r in records}) == [f"rank00007-{i:03d}.safetensors" for i in range(5)]
    for record in records:
        loaded = load_file(tmp_dir / record["file"])  # plain safetensors, readable by anyone
        assert torch.equal(loaded[record["key"]], tensor[record["start"] : record["end"]])
        assert record["crc32"] == zlib.crc32(tensor[record["start"] : record["end"]].numpy().tobytes())


def test_bf16_chunk_checksum_is_over_raw_bytes(tmp_path: Path) -> None:
    values = torch.randn(33).to(torch.bfloat16)
    tmp_dir = make_tmp_dir(tmp_path, "t", "n")
    writer = CheckpointWriter(tmp_dir, 0, chunk_bytes=20)
    writer.add("optim/x/exp_avg", (33,), 0, values)
    records = writer.finish()
    raw = values.view(torch.int16).numpy()  # bf16 bit patterns, independently of the store's byte view
    for record in records:
        assert record["crc32"] == zlib.crc32(raw[record["start"] : record["end"]].tobytes())
    assert [r["end"] - r["start"] for r in records] == [10, 10, 10, 3]
    commit_checkpoint(tmp_path, "t", tmp_dir, records, {}, True)
    assert torch.equal(CheckpointReader(tmp_path / "t").read_full("optim/x/exp_avg"), values)


def test_sub_range_reads_open_only_the_overlapping_files_and_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensor = torch.arange(1000, dtype=torch.float32)
    tmp_dir = make_tmp_dir(tmp_path, "t", "n")
    writer = CheckpointWriter(tmp_dir, 0, chunk_bytes=400, file_bytes=800)  # chunk i = [100i, 100i+100)
    writer.add("param/w", (1000,), 0, tensor)
    commit_checkpoint(tmp_path, "t", tmp_dir, writer.finish(), {}, True)
    opened: list[str] = []
    real_safe_open = store_module.safe_open

    def counting_safe_open(path: str, framework: str):
        opened.append(Path(path).name)
        return real_safe_open(path, framework=framework)

    monkeypatch.setattr(store_module, "safe_open", counting_safe_open)
    reader = CheckpointReader(tmp_path / "t")
    assert torch.equal(reader.read_range("param/w", 250, 420), tensor[250:420])
    # Elements 250..419 lie in chunks 2, 3 (file 001) and 4 (file 002).
    assert opened == ["rank00000-001.safetensors", "rank00000-002.safetensors"]
    assert reader.chunks_read == 3
    assert torch.equal(reader.read_range("param/w", 300, 300), tensor[:0])
    assert reader.chunks_read == 3


def test_reader_keeps_a_bounded_number_of_files_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tensor = torch.arange(1000, dtype=torch.float32)
    tmp_dir = make_tmp_dir(tmp_path, "t", "n")
    writer = CheckpointWriter(tmp_dir, 0, chunk_bytes=400, file_bytes=400)  # 10 files of one chunk
    writer.add("param/w", (1000,), 0, tensor)
    commit_checkpoint(tmp_path, "t", tmp_dir, writer.finish(), {}, True)
    monkeypatch.setattr(store_module, "MAX_OPEN_FILES", 3)
    reader = CheckpointReader(tmp_path / "t")
    assert torch.equal(reader.read_full("param/w"), tensor)
    assert reader.files_opened == 10 and len(reader._handles) == 3
    assert torch.equal(reader.read_range("param/w", 0, 1000), tensor)  # reopened files still verified
    assert reader.files_opened == 20


def _records(*pieces: tuple[str, list[int], int, int]) -> list[dict]:
    return [
        {"name": n, "shape": s, "dtype": "float32", "file": "f", "key": f"{n}@{a}", "start": a, "end": b, "crc32": 0}
        for n, s, a, b in pieces
    ]


@pytest.mark.parametrize(
    ("records", "message"),
    [
        (_records(("w", [10], 0, 4), ("w", [10], 6, 10)), "elements [4, 6) are written by no rank"),
        (_records(("w", [10], 0, 6), ("w", [10], 4, 10)), "overlaps"),
        (_records(("w", [10], 0, 10), ("w", [10], 0, 10)), "overlaps"),
        (_records(("w", [10], 0, 8)), "elements [8, 10) are written by no rank"),
        (_records(("w", [10], 0, 12)), "ends beyond the tensor"),
        (_records(("w", [10], 0, 5), ("w", [2, 5], 5, 10)), "shape [10] and with shape [2, 5]"),
        (_records(("w", [4], 1, 4)), "elements [0, 1) are written by no rank"),
    ],
)
def test_commit_rejects_bad_tilings_naming_the_tensor(tmp_path: Path, records: list[dict], message: str) -> None:
    tmp_dir = make_tmp_dir(tmp_path, "t", "n")
    (tmp_dir / "f").write_bytes(b"")
    with pytest.raises(CheckpointTilingError, match="'w'") as caught:
        commit_checkpoint(tmp_path, "t", tmp_dir, records, {}, True)
    assert message in str(caught.value)
    assert tmp_dir.is_dir() and not (tmp_path / "t").exists() and read_latest(tmp_path) is None


def test_declared_but_unwritten_tensor_and_dtype_disagreement(tmp_path: Path) -> None:
    tmp_dir = make_tmp_dir(tmp_path, "t", "n")
    writer = CheckpointWriter(tmp_dir, 0)
    writer.add("param/empty_share", (4,), 0, torch.empty(0))
    with pytest.raises(CheckpointTilingError, match=r"'param/empty_share'.*\[0, 4\) are written by no rank"):
        commit_checkpoint(tmp_path, "t", tmp_dir, writer.finish(), {}, True)
    other = CheckpointWriter(tmp_dir, 1)
    other.add("param/w", (4,), 0, torch.zeros(2))
    other.add("param/w", (4,), 2, torch.zeros(2, dtype=torch.float16))
    with pytest.raises(CheckpointTilingError, match="'param/w' is written with dtype float32 and with float16"):
        commit_checkpoint(tmp_path, "t", tmp_dir, other.finish(), {}, True)


def test_writer_rejects_bad_pieces(tmp_path: Path) -> None:
    writer = CheckpointWriter(make_tmp_dir(tmp_path, "t", "n"), 0)
    with pytest.raises(ValueError, match="'w': data must be a 1-D tensor"):
        writer.add("w", (2, 2), 0, torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"'w': start=3 with 2 elements does not fit .* \(4 elements\)"):
        writer.add("w", (2, 2), 3, torch.zeros(2))
    writer.add("w", (2, 2), 0, torch.zeros(2))
    with pytest.raises(ValueError, match="already added a piece covering element 0"):
        writer.add("w", (2, 2), 0, torch.zeros(2))
    with pytest.raises(ValueError, match=r"dtype torch\.complex64 is not storable"):
        writer.add("c", (2,), 0, torch.zeros(2, dtype=torch.complex64))
    writer.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        writer.add("v", (1,), 0, torch.zeros(1))
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        CheckpointWriter(tmp_path / "nowhere", 0)


def test_writer_copies_its_input(tmp_path: Path) -> None:
    tmp_dir = make_tmp_dir(tmp_path, "t", "n")
    writer = CheckpointWriter(tmp_dir, 0)
    buffer = torch.ones(8)
    writer.add("param/w", (8,), 0, buffer)
    buffer.zero_()  # a caller reusing its staging buffer must not change what was saved
    commit_checkpoint(tmp_path, "t", tmp_dir, writer.finish(), {}, True)
    assert torch.equal(CheckpointReader(tmp_path / "t").read_full("param/w"), torch.ones(8))


def test_metadata_round_trip_and_non_json_metadata_named(tmp_path: Path) -> None:
    metadata = {"counters": {"global_steps": 5}, "rng": ["aGVsbG8="], "scale": float("inf"), "none": None}
    save_pieces(tmp_path, "t", {"param/w": torch.ones(3)}, metadata=metadata)
    assert CheckpointReader(tmp_path / "t").metadata == metadata
    tmp_dir = make_tmp_dir(tmp_path, "u", "n")
    with pytest.raises(CheckpointError, match=r"metadata\['client_state'\]\['step'\] \(Tensor\)"):
        commit_checkpoint(tmp_path, "u", tmp_dir, [], {"client_state": {"step": torch.tensor(1)}}, True)
    with pytest.raises(CheckpointError, match=r"metadata\['x'\] key 1 \(int"):
        commit_checkpoint(tmp_path, "u", tmp_dir, [], {"x": {1: 2}}, True)


def _flip_last_byte(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0x40]))


def _single_file_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    tmp_dir = make_tmp_dir(tmp_path, "t", "n")
    writer = CheckpointWriter(tmp_dir, 0, chunk_bytes=40)
    writer.add("param/w", (100,), 0, torch.arange(100, dtype=torch.float32))
    commit_checkpoint(tmp_path, "t", tmp_dir, writer.finish(), {}, True)
    return tmp_path / "t", tmp_path / "t" / "rank00000-000.safetensors"


def test_flipped_byte_is_detected_by_the_rank_reading_that_chunk(tmp_path: Path) -> None:
    ckpt, data_file = _single_file_checkpoint(tmp_path)
    _flip_last_byte(data_file)  # the last chunk's data: elements [90, 100)
    reader = CheckpointReader(ckpt)
    assert torch.equal(reader.read_range("param/w", 0, 90), torch.arange(90, dtype=torch.float32))
    with pytest.raises(CheckpointCorruptError) as caught:
        reader.read_range("param/w", 95, 96)
    message = str(caught.value)
    assert str(data_file) in message and "'param/w'" in message and "crc32" in message


def test_truncated_and_missing_data_files_are_named(tmp_path: Path) -> None:
    ckpt, data_file = _single_file_checkpoint(tmp_path)
    os.truncate(data_file, data_file.stat().st_size - 4)
    with pytest.raises(CheckpointCorruptError, match="truncated or corrupt") as caught:
        CheckpointReader(ckpt).read_full("param/w")
    assert str(data_file) in str(caught.value) and "'param/w'" in str(caught.value)
    data_file.unlink()
    with pytest.raises(CheckpointCorruptError, match=f"{data_file}.*'param/w'.* is missing"):
        CheckpointReader(ckpt).read_range("param/w", 0, 1)


def test_header_damage_is_named(tmp_path: Path) -> None:
    ckpt, data_file = _single_file_checkpoint(tmp_path)
    raw = bytearray(data_file.read_bytes())
    (header_length,) = struct.unpack("<Q", raw[:8])
    raw[8 + header_length // 2] = ord("}")
    data_file.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match=str(data_file)):
        CheckpointReader(ckpt).read_full("param/w")


@pytest.mark.parametrize("damaged", ["index.json", "metadata.json"])
def test_bad_or_missing_json_files_are_named(tmp_path: Path, damaged: str) -> None:
    ckpt, _ = _single_file_checkpoint(tmp_path)
    (ckpt / damaged).write_text('{"format_version": 1, "tensors": {', encoding="utf-8")
    with pytest.raises(CheckpointCorruptError, match=f"{ckpt / damaged} is not valid JSON"):
        CheckpointReader(ckpt)
    (ckpt / damaged).unlink()
    with pytest.raises(CheckpointNotFoundError, match=f"{ckpt / damaged} does not exist"):
        CheckpointReader(ckpt)


def test_hand_edited_index_is_rejected_and_newer_format_explained(tmp_path: Path) -> None:
    ckpt, _ = _single_file_checkpoint(tmp_path)
    index = json.loads((ckpt / "index.json").read_text())
    index["tensors"]["param/w"]["chunks"].pop(3)
    (ckpt / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointCorruptError, match=r"index.json: tensor 'param/w'.*\[30, 40\) are written by no"):
        CheckpointReader(ckpt)
    index["format_version"] = 99
    (ckpt / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="format version 99 was written by a newer shardspeed"):
        CheckpointReader(ckpt)


def test_reader_errors_for_unknown_names_and_ranges(tmp_path: Path) -> None:
    ckpt, _ = _single_file_checkpoint(tmp_path)
    reader = CheckpointReader(ckpt)
    with pytest.raises(KeyError, match=r"no tensor 'param/v'.*did you mean \"param/w\""):
        reader.read_full("param/v")
    with pytest.raises(ValueError, match=r"range \[90, 101\) is outside its 100 elements"):
        reader.read_range("param/w", 90, 101)
    with pytest.raises(ValueError, match="outside"):
        reader.iter_range("param/w", 5, 4)


def test_resolve_tag_messages(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=f"checkpoint directory {tmp_path / 'none'} does not exist"):
        resolve_tag(tmp_path / "none", None)
    with pytest.raises(CheckpointNotFoundError, match=r"no 'latest' file in .*holds no committed checkpoint"):
        resolve_tag(tmp_path, None)
    save_pieces(tmp_path, "global_step5", {"param/w": torch.ones(2)}, save_latest=False)
    with pytest.raises(CheckpointNotFoundError, match=r"no 'latest' file .*committed tags: global_step5"):
        resolve_tag(tmp_path, None)
    assert resolve_tag(tmp_path, "global_step5") == "global_step5"
    with pytest.raises(CheckpointNotFoundError, match=r"tag 'global_step6': .* does not exist .*global_step5"):
        resolve_tag(tmp_path, "global_step6")
    (tmp_path / "latest").write_text("global_step9")
    with pytest.raises(CheckpointNotFoundError, match="'latest' names tag 'global_step9', but"):
        resolve_tag(tmp_path, None)
    (tmp_path / "latest").write_text(".tmp-global_step5-n")
    with pytest.raises(CheckpointError, match=r"latest: checkpoint tag '\.tmp-global_step5-n' is invalid"):
        resolve_tag(tmp_path, None)
    (tmp_path / "latest").write_text("")
    with pytest.raises(CheckpointError, match="latest is empty"):
        resolve_tag(tmp_path, None)
    for bad in ["a/b", ".hidden", "latest", " x", ""]:
        with pytest.raises(CheckpointError, match="tag"):
            resolve_tag(tmp_path, bad)


def test_saving_an_existing_tag_replaces_it(tmp_path: Path) -> None:
    save_pieces(tmp_path, "t", {"param/w": torch.ones(4)}, seed=1)
    save_pieces(tmp_path, "t", {"param/w": torch.full((4,), 2.0)}, seed=2)
    assert torch.equal(CheckpointReader(tmp_path / "t").read_full("param/w"), torch.full((4,), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "t"]


def test_crash_before_rename_keeps_previous_latest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_pieces(tmp_path, "old", {"param/w": torch.ones(4)}, seed=1)
    real_rename = os.rename

    def crashing_rename(source: os.PathLike, target: os.PathLike) -> None:
        if Path(source).name.startswith(".tmp-new-"):
            raise KeyboardInterrupt("simulated kill before the rename")
        real_rename(source, target)

    monkeypatch.setattr(commit_module.os, "rename", crashing_rename)
    with pytest.raises(KeyboardInterrupt):
        save_pieces(tmp_path, "new", {"param/w": torch.zeros(4)}, seed=2)
    monkeypatch.undo()
    assert read_latest(tmp_path) == "old" and resolve_tag(tmp_path, None) == "old"
    assert list_tags(tmp_path) == ["old"]
    assert torch.equal(CheckpointReader(tmp_path / "old").read_full("param/w"), torch.ones(4))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers == [".tmp-new-nonce2"]
    assert cleanup_stale_tmp(tmp_path) == []  # fresh: could be a save in progress
    assert cleanup_stale_tmp(tmp_path, min_age_s=60, now=time.time() + 120) == [tmp_path / ".tmp-new-nonce2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "old"]


def test_crash_after_rename_before_latest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_pieces(tmp_path, "old", {"param/w": torch.ones(4)}, seed=1)

    def crash(save_dir: Path, tag: str) -> None:
        raise KeyboardInterrupt("simulated kill before latest is replaced")

    monkeypatch.setattr(commit_module, "write_latest", crash)
    with pytest.raises(KeyboardInterrupt):
        save_pieces(tmp_path, "new", {"param/w": torch.zeros(4)}, seed=2)
    assert resolve_tag(tmp_path, None) == "old"
    assert torch.equal(CheckpointReader(tmp_path / "new").read_full("param/w"), torch.zeros(4))


def test_crash_between_the_replacing_renames_points_to_the_old_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_pieces(tmp_path, "t", {"param/w": torch.ones(4)}, seed=1)
    real_rename = os.rename

    def crashing_rename(source: os.PathLike, target: os.PathLike) -> None:
        if Path(source).name.startswith(".tmp-"):
            raise KeyboardInterrupt("simulated kill between the renames")
        real_rename(source, target)

    monkeypatch.setattr(commit_module.os, "rename", crashing_rename)
    with pytest.raises(KeyboardInterrupt):
        save_pieces(tmp_path, "t", {"param/w": torch.zeros(4)}, seed=2)
    with pytest.raises(CheckpointNotFoundError, match=r"previous copy .* is at .*\.old-t-nonce2"):
        resolve_tag(tmp_path, None)


KILLED_SAVE = """
import os, signal, sys, torch
from pathlib import Path
from shardspeed.checkpoint.commit import commit_checkpoint, make_tmp_dir
from shardspeed.checkpoint.store import CheckpointWriter
save_dir = Path(sys.argv[1])
for tag, value in (("first", 1.0), ("second", 2.0)):
    tmp_dir = make_tmp_dir(save_dir, tag, "n")
    writer = CheckpointWriter(tmp_dir, 0, chunk_bytes=64, file_bytes=128)
    writer.add("param/w", (100,), 0, torch.full((60,), value))
    if tag == "second":
        os.kill(os.getpid(), signal.SIGKILL)  # mid-save: one file written, the rest never
    writer.add("param/w", (100,), 60, torch.full((40,), value))
    commit_checkpoint(save_dir, tag, tmp_dir, writer.finish(), {"tag": tag}, True)
"""


def test_kill_9_during_save_leaves_previous_checkpoint_latest(tmp_path: Path) -> None:
    environment = {**os.environ, "PYTHONPATH": str(REPO_SRC)}
    completed = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(tmp_path)], env=environment, timeout=60)
    assert completed.returncode == -signal.SIGKILL
    assert resolve_tag(tmp_path, None) == "first"
    reader = CheckpointReader(tmp_path / "first")
    assert reader.metadata == {"tag": "first"}
    assert torch.equal(reader.read_full("param/w"), torch.ones(100))
    assert any(p.name.startswith(".tmp-second-") for p in tmp_path.iterdir())


def test_safetensors_stream_writer_alignment_matches_numpy(tmp_path: Path) -> None:
    tensors = {"a_u8": torch.arange(3, dtype=torch.uint8), "b_f64": torch.randn(3, dtype=torch.float64)}
    tmp_dir = make_tmp_dir(tmp_path, "t", "n")
    writer = CheckpointWriter(tmp_dir, 0)
    for name, tensor in tensors.items():
        writer.add(name, (3,), 0, tensor)
    commit_checkpoint(tmp_path, "t", tmp_dir, writer.finish(), {}, True)
    raw = (tmp_path / "t" / "rank00000-000.safetensors").read_bytes()
    (header_length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_length])
    assert (8 + header_length) % 8 == 0
    begin, end = header["b_f64@0"]["data_offsets"]
    assert begin % 8 == 0
    data = np.frombuffer(raw[8 + header_length + begin : 8 + header_length + end], dtype=np.float64)
    assert np.array_equal(data, tensors["b_f64"].numpy())


def test_commit_removes_only_killed_saves_of_the_same_tag(tmp_path: Path) -> None:
    """Committing tag 't' removes '.tmp-t-<uuid hex>' left by a killed save of 't', not another tag's ('t-x')."""
    killed = tmp_path / f".tmp-t-{'a' * 32}"
    other_tag = tmp_path / f".tmp-t-x-{'b' * 32}"
    for leftover in (killed, other_tag):
        leftover.mkdir()
        (leftover / "rank00000-000.safetensors").write_bytes(b"partial")
    writer = CheckpointWriter(make_tmp_dir(tmp_path, "t", "c" * 32), rank=0)
    writer.add("w", (2,), 0, torch.ones(2))
    commit_checkpoint(tmp_path, "t", tmp_path / f".tmp-t-{'c' * 32}", writer.finish(), {}, True)
    assert not killed.exists() and other_tag.is_dir()
    assert read_latest(tmp_path) == "t"
