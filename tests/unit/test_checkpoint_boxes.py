"""checkpoint/boxes.py: flat ranges of boxes of global tensors, checked against brute force on random boxes."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from shardspeed.checkpoint.box_io import read_local_into, write_local
from shardspeed.checkpoint.boxes import (
    BoxRef,
    count_before,
    intersect,
    local_runs,
    overlaps,
    restrict,
    sub_to_outer,
    whole,
)
from shardspeed.checkpoint.commit import commit_checkpoint, make_tmp_dir
from shardspeed.checkpoint.index import CheckpointTilingError, build_index
from shardspeed.checkpoint.store import CheckpointReader, CheckpointWriter


def _random_box(rng: random.Random, shape: tuple[int, ...]) -> BoxRef:
    offset, size = [], []
    for d in shape:
        lo = rng.randrange(d)
        offset.append(lo)
        size.append(rng.randint(1, d - lo))
    return BoxRef(tuple(offset), tuple(size))


def _box_ids(shape: tuple[int, ...], box: BoxRef) -> torch.Tensor:
    """Global flat ids of ``box``'s elements, in the box's flat order."""
    ids = torch.arange(math.prod(shape)).view(shape)
    for dim, (o, s) in enumerate(zip(box.offset, box.shape)):
        ids = ids.narrow(dim, o, s)
    return ids.reshape(-1)


def _apply(transfers, src: torch.Tensor, dst: torch.Tensor) -> None:
    for t in transfers:
        if t.src_index is None:
            dst[t.dst_start : t.dst_start + t.count] = src[t.src_start : t.src_start + t.count]
        else:
            assert int(t.src_index[0]) == t.src_start and int(t.dst_index[0]) == t.dst_start
            assert t.src_span >= t.count
            dst[t.dst_index] = src[t.src_index]


def test_count_before_and_restrict_match_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        sub = _random_box(rng, shape)
        members = set(_box_ids(shape, sub).tolist())
        numel = math.prod(shape)
        for flat in range(numel + 1):
            assert count_before(shape, flat, sub) == sum(1 for m in members if m < flat)
        a, b = sorted(rng.randint(0, numel) for _ in range(2))
        lo, hi = restrict(shape, a, b, sub)
        ids = _box_ids(shape, sub)
        # the box elements whose flat position lies in [a, b) are exactly box positions [lo, hi)
        inside = [i for i, g in enumerate(ids.tolist()) if a <= g < b]
        assert inside == list(range(lo, hi))
        for i in range(sub.numel):
            assert sub_to_outer(shape, sub, i) == int(ids[i])


def test_overlaps_match_brute_force_on_random_boxes_and_ranges() -> None:
    rng = random.Random(1)
    for trial in range(400):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        src, dst = _random_box(rng, shape), _random_box(rng, shape)
        ss, se = sorted(rng.randint(0, src.numel) for _ in range(2))
        ts, te = sorted(rng.randint(0, dst.numel) for _ in range(2))
        src_ids, dst_ids = _box_ids(shape, src), _box_ids(shape, dst)
        values = src_ids[ss:se].double() + 0.5  # the saved record: a flat range of the source box
        got = torch.full((te - ts,), -1.0, dtype=torch.float64)
        _apply(overlaps(src, ss, se, dst, ts, te, block=rng.choice([1, 3, 1 << 20])), values, got)
        held = set(src_ids[ss:se].tolist())
        want = torch.tensor([g + 0.5 if g in held else -1.0 for g in dst_ids[ts:te].tolist()], dtype=torch.float64)
        assert torch.equal(got, want), (trial, shape, src, (ss, se), dst, (ts, te))


def test_dp_only_overlap_is_one_contiguous_transfer() -> None:
    box = whole((7, 13))
    transfers = list(overlaps(box, 20, 60, box, 50, 91))
    assert [(t.count, t.src_start, t.dst_start, t.src_index) for t in transfers] == [(10, 30, 0, None)]
    column = BoxRef((4, 0), (3, 13))  # a dim-0 (column-parallel) slice: contiguous too
    assert all(t.src_index is None for t in overlaps(box, 0, 91, column, 0, 39))


def test_intersect() -> None:
    assert intersect(BoxRef((0, 2), (4, 3)), BoxRef((1, 0), (2, 4))) == BoxRef((1, 2), (2, 2))
    assert intersect(BoxRef((0, 0), (2, 2)), BoxRef((0, 2), (2, 2))) is None


@pytest.mark.parametrize("parts", [1, 3])
def test_local_runs_cut_a_zero_shard_per_box(parts: int) -> None:
    """A flat ZeRO shard of a fused local parameter (boxes side by side along dim 1) splits into one flat range of
    each box; the positions point at the right local elements."""
    local_shape = (4, 2 * parts)
    local = torch.arange(8 * parts, dtype=torch.float64).view(local_shape)
    boxes = [BoxRef((0, 2 * i), (4, 2)) for i in range(parts)]
    for start, end in [(0, 8 * parts), (3, 5 * parts + 1), (5, 6)]:
        shard = local.reshape(-1)[start:end]
        for box in boxes:
            a, b, t = local_runs(local_shape, start, end, box)
            box_values = local.narrow(1, box.offset[1], 2).reshape(-1)[a:b]
            if t is None:
                assert a == b
                continue
            picked = shard[t.dst_start : t.dst_start + t.count] if t.dst_index is None else shard[t.dst_index]
            assert torch.equal(picked, box_values)


def _write_sliced(tmp_path, full: torch.Tensor, boxes: list[BoxRef], data_ranks: int = 2) -> list[dict]:
    """Each box written as ``data_ranks`` flat ranges (a ZeRO shard per data rank), by separate writers."""
    records = []
    tmp = make_tmp_dir(tmp_path, "t", "n" * 32)
    for i, box in enumerate(boxes):
        values = full[tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape))].reshape(-1)
        cut = [box.numel * r // data_ranks for r in range(data_ranks + 1)]
        for r in range(data_ranks):
            writer = CheckpointWriter(tmp, i * data_ranks + r, chunk_bytes=12)
            writer.add("param/w", full.shape, cut[r], values[cut[r] : cut[r + 1]].clone(), box=box)
            records += writer.finish()
    return records


def test_store_round_trips_boxes_and_reads_any_slice(tmp_path) -> None:
    full = torch.arange(35, dtype=torch.float32).view(5, 7)
    boxes = [BoxRef((0, 0), (5, 4)), BoxRef((0, 4), (5, 3))]  # TP=2 along dim 1 (ceil chunks)
    commit_checkpoint(tmp_path, "t", tmp_path / f".tmp-t-{'n' * 32}", _write_sliced(tmp_path, full, boxes), {})
    reader = CheckpointReader(tmp_path / "t")
    assert reader.boxes("param/w") == boxes and reader.shape("param/w") == (5, 7)
    assert torch.equal(reader.read_full("param/w"), full)  # zero-to-fp32's path: assembled from the boxes
    assert torch.equal(reader.read_range("param/w", 9, 30), full.reshape(-1)[9:30])
    # a TP=3 rank's slice along dim 1 (columns [3, 6)), a ZeRO shard of it: local elements [2, 13)
    local = BoxRef((0, 0), (5, 3))
    out = torch.zeros(11)
    read_local_into(reader, "param/w", [(local, BoxRef((0, 3), (5, 3)))], (5, 3), 2, out)
    assert torch.equal(out, full[:, 3:6].reshape(-1)[2:13])
    index = json.loads((tmp_path / "t" / "index.json").read_text())
    assert index["format_version"] == 2
    assert {tuple(c["box_offset"]) for c in index["tensors"]["param/w"]["chunks"]} == {(0, 0), (0, 4)}


def test_boxes_that_overlap_or_leave_a_gap_fail_the_commit(tmp_path) -> None:
    full = torch.arange(35, dtype=torch.float32).view(5, 7)
    overlapping = [BoxRef((0, 0), (5, 4)), BoxRef((0, 3), (5, 4))]
    with pytest.raises(CheckpointTilingError, match="boxes at \\[0, 0\\] and \\[0, 3\\] overlap"):
        build_index(_write_sliced(tmp_path / "a", full, overlapping))
    with pytest.raises(CheckpointTilingError, match="written by no rank"):
        build_index(_write_sliced(tmp_path / "b", full, [BoxRef((0, 0), (5, 4))]))


def test_write_local_cuts_a_shard_of_a_fused_parameter_per_box(tmp_path) -> None:
    """A ZeRO shard of a TP rank's fused parameter (two boxes along dim 0) is stored as flat ranges of the boxes,
    and reads back into the same local positions."""
    spec_boxes = [(BoxRef((0, 0), (2, 3)), BoxRef((1, 0), (2, 3))), (BoxRef((2, 0), (2, 3)), BoxRef((5, 0), (2, 3)))]
    local = torch.arange(12, dtype=torch.float32) + 100
    tmp = make_tmp_dir(tmp_path, "t", "m" * 32)
    writer = CheckpointWriter(tmp, 0)
    write_local(writer, "param/q", (8, 3), spec_boxes, (4, 3), 4, local[4:11])
    records = writer.finish()
    assert [(r["start"], r["end"], r["box_offset"]) for r in records] == [(4, 6, [1, 0]), (0, 5, [5, 0])]


def test_format_1_checkpoint_reads_as_one_box_per_tensor() -> None:
    """The DP-only fixture written by the pre-box code: no box fields, each tensor one box covering it."""
    from pathlib import Path

    from safetensors.torch import load_file

    fixture = Path(__file__).parents[1] / "fixtures" / "checkpoints" / "dp_only_v1"
    assert json.loads((fixture / "v1" / "index.json").read_text())["format_version"] == 1
    expected = load_file(str(fixture / "expected.safetensors"))
    with CheckpointReader(fixture / "v1") as reader:
        assert reader.boxes("param/0.weight") == [whole((6, 5))]
        for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
            assert torch.equal(reader.read_full(f"param/{name}"), expected[f"param/{name}"])
            assert torch.equal(reader.read_full(f"optim/{name}/exp_avg"), expected[f"exp_avg/{name}"])
