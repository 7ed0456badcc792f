"""[Note: collective algorithms] (comm/algorithms.py): the choice from timings, the knee, the table, the cache,
and the engine's bucket defaults. Pure: no process group."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path

import pytest

from shardspeed.comm.algorithms import (
    NATIVE,
    CollectiveChoice,
    CurvePoint,
    SizeRule,
    Timing,
    choose,
    cores_per_rank,
    default_bucket_numel,
    from_json,
    knee_bytes,
    table_choice,
    to_json,
)
from shardspeed.comm.calibrate import cache_dir, cache_file, cache_key, load_cached, store_cached
from shardspeed.config import ZeroConfig
from shardspeed.engine_setup import bucket_defaults

K, M = 1 << 10, 1 << 20
SIZES = (16 * K, 64 * K, 256 * K, M, 4 * M, 16 * M)


def _timings(rs_native, rs_alt, ag_native, ag_alt) -> list[Timing]:
    out = []
    for i, size in enumerate(SIZES):
        out += [
            Timing("reduce_scatter", "native", size, rs_native[i]),
            Timing("reduce_scatter", "all_reduce", size, rs_alt[i]),
            Timing("all_gather", "native", size, ag_native[i]),
            Timing("all_gather", "broadcast", size, ag_alt[i]),
        ]
    return out


def test_alternative_wins_only_where_clearly_faster() -> None:
    ones = [1.0] * 6
    # reduce-scatter: all-reduce 5% faster everywhere (inside the margin) -> native stays
    # all-gather: broadcast 3x faster everywhere -> broadcast
    choice = choose(_timings(ones, [0.95] * 6, ones, [1 / 3] * 6), world=2, itemsize=4)
    assert choice.reduce_scatter == (SizeRule(None, "native"),)
    assert choice.all_gather == (SizeRule(None, "broadcast"),)
    assert choice.algorithm("all_gather", 1) == "broadcast" and choice.algorithm("reduce_scatter", 10**9) == "native"


def test_one_crossover_cut_halfway_between_ladder_sizes() -> None:
    ones = [1.0] * 6
    # broadcast slower below 1 MiB, twice as fast from 1 MiB on
    choice = choose(_timings(ones, ones, ones, [2, 2, 2, 0.5, 0.5, 0.5]), world=2, itemsize=4)
    assert choice.all_gather == (SizeRule(512 * K, "native"), SizeRule(None, "broadcast"))  # sqrt(256K · 1M)
    assert choice.algorithm("all_gather", 512 * K) == "native"
    assert choice.algorithm("all_gather", 512 * K + 1) == "broadcast"


def test_noise_does_not_flip_back_and_forth() -> None:
    """A curve that wiggles around native gets at most one crossover (the least total log-time)."""
    ones = [1.0] * 6
    wiggle = [0.5, 1.5, 0.5, 0.5, 0.5, 0.5]
    choice = choose(_timings(wiggle, ones, ones, ones), world=2, itemsize=4)  # native RS wins 5 of 6 sizes
    assert choice.reduce_scatter == (SizeRule(None, "native"),)
    assert len(choose(_timings(ones, wiggle, ones, ones), world=2, itemsize=4).reduce_scatter) <= 2


def test_curve_is_the_chosen_pair_bus_bandwidth() -> None:
    t = [1e-3 * (i + 1) for i in range(6)]
    choice = choose(_timings(t, t, t, t), world=4, itemsize=4)
    first = choice.curve[0]
    assert first.nbytes == 16 * K
    assert first.bus_gbps == pytest.approx(2 * 16 * K * 3 / 4 / (2e-3) / 1e9)


def test_knee_is_the_smallest_size_reaching_ninety_percent() -> None:
    curve = [CurvePoint(1 * K, 0.1), CurvePoint(4 * K, 0.5), CurvePoint(16 * K, 0.91), CurvePoint(64 * K, 1.0)]
    assert knee_bytes(curve) == 16 * K
    assert knee_bytes(curve, fraction=0.95) == 64 * K
    assert knee_bytes([]) is None
    assert default_bucket_numel(CollectiveChoice(curve=tuple(curve), itemsize=4)) == 4 * K
    assert default_bucket_numel(CollectiveChoice(curve=tuple(curve), itemsize=2)) == 8 * K
    assert default_bucket_numel(NATIVE) is None


def test_table_gloo_measured_nccl_native() -> None:
    assert table_choice("nccl", 8) == NATIVE
    assert table_choice("gloo", 1) == NATIVE
    gloo2, gloo4 = table_choice("gloo", 2), table_choice("gloo", 4)
    # What was measured here (comm/algorithms.py's table): all-reduce-then-slice at every size on world 2,
    # per-owner broadcasts for large all-gathers on both world sizes.
    assert gloo2.reduce_scatter == (SizeRule(None, "all_reduce"),)
    assert gloo2.algorithm("all_gather", 16 * M) == "broadcast"
    assert gloo4.algorithm("all_gather", 16 * M) == "broadcast"
    assert "world 4" in table_choice("gloo", 8).source
    assert default_bucket_numel(gloo2) == M  # the knee: 4 MiB of fp32


def test_serialized_form_round_trips_and_rejects_a_foreign_key() -> None:
    choice = table_choice("gloo", 2)
    key = {"backend": "gloo", "world": 2}
    back = from_json(json.loads(json.dumps(to_json(choice, key))), key)
    assert back == choice  # timings are not compared; rules, curve, itemsize are
    assert back.source == "cache"
    with pytest.raises(ValueError, match="made for"):
        from_json(to_json(choice, key), {"backend": "gloo", "world": 4})
    bad = to_json(choice, key)
    bad["all_gather"] = [[None, "scatter_gather"]]
    with pytest.raises(ValueError, match="unknown algorithm 'scatter_gather'"):
        from_json(bad, key)


def test_cache_round_trip_and_corruption(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import torch

    key = cache_key("gloo", 2, torch.float32)
    path = cache_file(tmp_path, key)
    assert load_cached(path, key) is None  # missing: quietly None
    choice = table_choice("gloo", 2)
    store_cached(path, choice, key)
    assert load_cached(path, key) == choice
    assert load_cached(path, cache_key("gloo", 2, torch.bfloat16)) is None  # another dtype's key: ignored
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="shardspeed"):
        assert load_cached(path, key) is None
    assert "ignoring the cached collective calibration" in caplog.text and str(path) in caplog.text


def test_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSPEED_CACHE_DIR", str(tmp_path / "env"))
    assert cache_dir(None) == tmp_path / "env"
    assert cache_dir(str(tmp_path / "cfg")) == tmp_path / "cfg"
    monkeypatch.delenv("SHARDSPEED_CACHE_DIR")
    assert cache_dir(None) == Path.home() / ".cache" / "shardspeed"


def test_bucket_defaults_only_where_unset() -> None:
    choice = table_choice("gloo", 2)
    unset = bucket_defaults(ZeroConfig(stage=2), choice)
    assert (unset.reduce_bucket_size, unset.allgather_bucket_size) == (M, M)
    partly = bucket_defaults(ZeroConfig(stage=2, reduce_bucket_size=1000), choice)
    assert (partly.reduce_bucket_size, partly.allgather_bucket_size) == (1000, M)
    native = bucket_defaults(ZeroConfig(stage=2), NATIVE)
    assert native.reduce_bucket_size == 500_000_000  # no curve (native / NCCL): DeepSpeed's default stays


def test_cache_key_names_the_device(tmp_path: Path) -> None:
    """gloo on CUDA tensors copies through the host: a CPU calibration must not be reused for it (nor the reverse)."""
    import torch

    cpu, cuda = cache_key("gloo", 2, torch.float32), cache_key("gloo", 2, torch.float32, "cuda")
    assert cpu["device"] == "cpu" and cuda["device"] == "cuda"
    assert cache_file(tmp_path, cpu) != cache_file(tmp_path, cuda)
    store_cached(cache_file(tmp_path, cpu), table_choice("gloo", 2), cpu)
    assert load_cached(cache_file(tmp_path, cpu), cuda) is None  # a CPU file read under a CUDA key: foreign


def test_cores_per_rank_is_the_most_crowded_hosts_share() -> None:
    # two ranks unpinned on a 2-core host share both cores; a 16-core host with 4 pinned ranks has 4 each
    assert cores_per_rank([("a", [0, 1]), ("a", [0, 1])]) == 1.0
    assert cores_per_rank([("b", range(0, 4)), ("b", range(4, 8)), ("b", range(8, 12)), ("b", range(12, 16))]) == 4
    assert cores_per_rank([("a", [0, 1]), ("a", [0, 1]), ("b", range(16))]) == 1.0  # the minimum over hosts


def test_buckets_keep_deepspeeds_default_without_a_spare_core() -> None:
    """[Note: overlap needs a spare core]: one core per rank → DeepSpeed's one large bucket for both sizes."""
    crowded = replace(table_choice("gloo", 2, 4), cores_per_rank=1.0)
    roomy = replace(table_choice("gloo", 2, 4), cores_per_rank=8.0)
    assert default_bucket_numel(crowded) is None and default_bucket_numel(roomy) == M
    zero = bucket_defaults(ZeroConfig(stage=1), crowded)
    assert (zero.reduce_bucket_size, zero.allgather_bucket_size) == (500_000_000, 500_000_000)
    roomy_zero = bucket_defaults(ZeroConfig(stage=1), roomy)
    assert (roomy_zero.reduce_bucket_size, roomy_zero.allgather_bucket_size) == (M, M)


def test_usable_cpus_without_sched_getaffinity(monkeypatch: pytest.MonkeyPatch) -> None:
    """macOS has no os.sched_getaffinity: every CPU counts, so the engine's startup exchange still works there."""
    from shardspeed.comm.calibrate import usable_cpus

    assert usable_cpus() == sorted(os.sched_getaffinity(0))
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert usable_cpus() == [0, 1, 2]
