"""Pure mesh math: resolving the mesh from the raw config and an mpu, checking a foreign mpu's grid, and the
first-batch fingerprints. No processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardspeed.mesh import MeshError, MpuRecord, autotp_size_of, grid_from_mpu_records, resolve_mesh
from shardspeed.tensor_parallel.batch_check import batch_fingerprint, first_batch_difference
from shardspeed.topology import MeshShape


class _Mpu:
    """A Megatron-style mpu reporting sizes only (resolve_mesh reads no groups)."""

    def __init__(self, data: int, tensor: int, pipe: int | None = None) -> None:
        self.sizes = (data, tensor, pipe)

    def get_data_parallel_world_size(self) -> int:
        return self.sizes[0]

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.sizes[1]


class _MpuWithPipe(_Mpu):
    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.sizes[2] or 1


class _OldMpu:
    """Megatron's older names: "model parallel" meant the tensor axis."""

    def get_model_parallel_world_size(self) -> int:
        return 2

    def get_data_parallel_world_size(self) -> int:
        return 2


def test_no_tensor_parallel_config_is_all_data() -> None:
    assert resolve_mesh({"train_batch_size": 8}, 4) == MeshShape(data=4)
    assert resolve_mesh({"tensor_parallel": {"autotp_size": 0}}, 4) == MeshShape(data=4)
    assert resolve_mesh({"tensor_parallel": {"autotp_size": 1}}, 4) == MeshShape(data=4)
    assert resolve_mesh(None, 1) == MeshShape()


def test_autotp_size_sets_the_tensor_axis_and_dp_is_what_is_left() -> None:
    assert resolve_mesh({"tensor_parallel": {"autotp_size": 2}}, 4) == MeshShape(data=2, tensor=2)
    assert resolve_mesh({"tensor_parallel": {"autotp_size": 4}}, 8) == MeshShape(data=2, tensor=4)
    assert resolve_mesh({"tensor_parallel": {"autotp_size": 2}}, 2) == MeshShape(data=1, tensor=2)


def test_autotp_size_read_from_a_json_path(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "tensor_parallel": {"autotp_size": 2}}))
    assert resolve_mesh(str(path), 4) == MeshShape(data=2, tensor=2)
    assert autotp_size_of(str(tmp_path / "missing.json")) == 1  # unreadable: load_config reports it later


def test_world_not_divisible_names_the_numbers() -> None:
    with pytest.raises(MeshError, match=r"world size 6 is not divisible by tensor 4 × pipe 1 = 4"):
        resolve_mesh({"tensor_parallel": {"autotp_size": 4}}, 6)
    with pytest.raises(MeshError, match=r"world size 4 is not divisible by tensor 3 × pipe 1 = 3 \(from the mpu\)"):
        resolve_mesh({}, 4, _Mpu(1, 3))


def test_bad_autotp_size_is_named() -> None:
    with pytest.raises(MeshError, match="autotp_size must be a non-negative integer, got '2'"):
        resolve_mesh({"tensor_parallel": {"autotp_size": "2"}}, 4)
    with pytest.raises(MeshError, match="tensor_parallel must be a JSON object"):
        resolve_mesh({"tensor_parallel": 2}, 4)


def test_mpu_sizes_are_honoured() -> None:
    assert resolve_mesh({}, 4, _Mpu(2, 2)) == MeshShape(data=2, tensor=2)
    assert resolve_mesh({}, 8, _MpuWithPipe(2, 2, 2)) == MeshShape(pipe=2, data=2, tensor=2)
    assert resolve_mesh({}, 4, _OldMpu()) == MeshShape(data=2, tensor=2)
    # autotp_size naming the same size as the mpu is fine
    assert resolve_mesh({"tensor_parallel": {"autotp_size": 2}}, 4, _Mpu(2, 2)) == MeshShape(data=2, tensor=2)


def test_autotp_size_and_mpu_disagreeing_is_an_error() -> None:
    with pytest.raises(MeshError, match="autotp_size is 4 but the mpu's tensor-parallel world size is 2"):
        resolve_mesh({"tensor_parallel": {"autotp_size": 4}}, 8, _Mpu(4, 2))


def test_mpu_data_size_must_complete_the_world() -> None:
    with pytest.raises(MeshError, match=r"data-parallel world size 4 × tensor 2 × pipe 1 = 8 does not match"):
        resolve_mesh({}, 4, _Mpu(4, 2))


# --- a pipeline module's stages ----------------------------------------------------------------------------------
def test_pipeline_module_stages_set_the_pipe_axis() -> None:
    assert resolve_mesh({}, 4, pipeline_stages=2) == MeshShape(pipe=2, data=2)
    assert resolve_mesh({"pipeline": {"stages": "auto"}}, 8, pipeline_stages=4) == MeshShape(pipe=4, data=2)
    assert resolve_mesh({"pipeline": {"stages": 2}}, 2, pipeline_stages=2) == MeshShape(pipe=2, data=1)
    assert resolve_mesh({"tensor_parallel": {"autotp_size": 2}}, 8, pipeline_stages=2) == MeshShape(2, 2, 2)
    # an mpu naming the same pipe size agrees
    assert resolve_mesh({}, 8, _MpuWithPipe(2, 2, 2), pipeline_stages=2) == MeshShape(pipe=2, data=2, tensor=2)


def test_pipeline_stages_in_the_config_alone_make_no_pipe_axis() -> None:
    # a plain model cannot be split into stages; DeepSpeed ignores the key for it too
    assert resolve_mesh({"pipeline": {"stages": 2}}, 4) == MeshShape(data=4)


def test_pipeline_stages_disagreeing_are_errors_naming_the_numbers() -> None:
    with pytest.raises(MeshError, match=r"pipeline.stages is 4 but the pipeline module has 2 stages"):
        resolve_mesh({"pipeline": {"stages": 4}}, 8, pipeline_stages=2)
    with pytest.raises(MeshError, match=r"module has 2 stages but the mpu's pipeline-parallel world size is 4"):
        resolve_mesh({}, 8, _MpuWithPipe(1, 2, 4), pipeline_stages=2)
    with pytest.raises(MeshError, match=r"module has 2 stages but the mpu's pipeline-parallel world size is 1"):
        resolve_mesh({}, 4, _Mpu(2, 1), pipeline_stages=2)  # an mpu without a pipe axis has pipe size 1
    with pytest.raises(MeshError, match=r"world size 6 is not divisible by tensor 1 × pipe 4 = 4 .*pipeline module"):
        resolve_mesh({}, 6, pipeline_stages=4)
    with pytest.raises(MeshError, match=r"pipeline.stages must be \"auto\" or a positive integer, got 0"):
        resolve_mesh({"pipeline": {"stages": 0}}, 4, pipeline_stages=2)
    with pytest.raises(MeshError, match=r"stage count must be a positive integer, got 0"):
        resolve_mesh({}, 4, pipeline_stages=0)


# --- a foreign mpu's grid ---------------------------------------------------------------------------------------
def _records(tensor_groups: list[tuple[int, ...]], data_groups: list[tuple[int, ...]]) -> list[MpuRecord]:
    """Records of a world whose tensor and data groups are given (pipe of size 1)."""
    world = sum(len(g) for g in tensor_groups)
    out = []
    for r in range(world):
        tg = next(g for g in tensor_groups if r in g)
        dg = next(g for g in data_groups if r in g)
        out.append(MpuRecord((0, dg.index(r), tg.index(r)), ((r,), dg, tg)))
    return out


def test_default_layout_grid() -> None:
    shape, layout = grid_from_mpu_records(_records([(0, 1), (2, 3)], [(0, 2), (1, 3)]))
    assert shape == MeshShape(data=2, tensor=2)
    assert layout == (0, 1, 2, 3)


def test_non_default_layout_grid() -> None:
    shape, layout = grid_from_mpu_records(_records([(0, 2), (1, 3)], [(0, 1), (2, 3)]))
    assert shape == MeshShape(data=2, tensor=2)
    assert layout == (0, 2, 1, 3)  # (data 0, tensor 0)=0, (0, 1)=2, (1, 0)=1, (1, 1)=3


def test_groups_that_are_not_a_grid_are_named() -> None:
    # tensor groups {0,1},{2,3} with data groups {0,1},{2,3}: rank 0 and 1 share both groups
    records = _records([(0, 1), (2, 3)], [(0, 1), (2, 3)])
    with pytest.raises(MeshError, match=r"mpu layout: ranks 0 and 2 both claim \(pipe, data, tensor\) indices"):
        grid_from_mpu_records(records)
    # distinct indices, but rank 0's tensor group is not the ranks sharing its data index
    records = _records([(0, 1), (2, 3)], [(0, 2), (1, 3)])
    records[0] = MpuRecord((0, 0, 0), ((0,), (0, 2), (0, 3)))
    with pytest.raises(MeshError, match=r"rank 0's tensor group is \[0, 3\], but the ranks sharing its other "):
        grid_from_mpu_records(records)


def test_mismatched_sizes_and_errors_are_named() -> None:
    records: list = _records([(0, 1), (2, 3)], [(0, 2), (1, 3)])
    records[3] = MpuRecord((0, 0, 0), ((3,), (3,), (3,)))
    with pytest.raises(MeshError, match=r"rank 3 has group sizes \(pipe, data, tensor\) = \(1, 1, 1\)"):
        grid_from_mpu_records(records)
    records[3] = "reading its mpu failed: AttributeError: no"
    with pytest.raises(MeshError, match="mpu layout: rank 3: reading its mpu failed"):
        grid_from_mpu_records(records)


# --- first-batch fingerprints -----------------------------------------------------------------------------------
def test_batch_fingerprint_names_arguments_and_detects_one_changed_element() -> None:
    x = torch.arange(12, dtype=torch.float32).view(3, 4)
    base = batch_fingerprint((x,), {"labels": torch.tensor([1, 2, 3]), "flag": True})
    assert [e[0] for e in base] == ["args[0]", "kwargs['labels']"]
    same = batch_fingerprint((x.clone(),), {"labels": torch.tensor([1, 2, 3])})
    assert first_batch_difference([base, same], (0, 1)) is None
    y = x.clone()
    y[2, 3] += 1e-6
    other = batch_fingerprint((y,), {"labels": torch.tensor([1, 2, 3])})
    text = first_batch_difference([base, base, other], (4, 5, 6))
    assert text == "argument args[0] differs between ranks 4 and 6: its values differ (checksums)"
    shaped = batch_fingerprint((x[:2],), {"labels": torch.tensor([1, 2, 3])})
    assert "shape/dtype (3, 4) torch.float32 on rank 0 vs (2, 4) torch.float32 on rank 1" in str(
        first_batch_difference([base, shaped], (0, 1))
    )
    nested = batch_fingerprint(({"ids": x, "mask": [x > 1]},), {})
    assert [e[0] for e in nested] == ["args[0]['ids']", "args[0]['mask'][0]"]
    missing = batch_fingerprint((x,), {})
    assert first_batch_difference([base, missing], (0, 1)) == (
        "argument kwargs['labels'] is a tensor on rank 0 but not on rank 1"
    )


def test_engine_summary_shows_the_mesh() -> None:
    from types import SimpleNamespace

    from shardspeed.config import load_config
    from shardspeed.engine_setup import log_engine_summary

    lines: list[str] = []
    logger = SimpleNamespace(info=lambda fmt, *args: lines.append(fmt % args))
    config = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}, dp_world_size=2)
    topology = SimpleNamespace(shape=MeshShape(data=2, tensor=2), dp_world_size=2)
    predicted = SimpleNamespace(params=0, grads=0, optimizer=0, total=lambda: 0)
    log_engine_summary(logger, config, topology, 84, predicted)  # type: ignore[arg-type]
    assert "world 4 (mesh pipe 1 × data 2 × tensor 2)" in lines[0]
    assert "micro batch 2 × GAS 1 × data 2 = 4" in lines[0]


def test_batch_fingerprint_of_bf16_bool_and_empty_tensors() -> None:
    x = torch.linspace(0, 1, 6, dtype=torch.bfloat16)
    mask = torch.tensor([True, False, True])
    base = batch_fingerprint((x, mask, torch.empty(0)), {})
    assert [e[1:3] for e in base] == [((6,), "torch.bfloat16"), ((3,), "torch.bool"), ((0,), "torch.float32")]
    flipped = batch_fingerprint((x, ~mask, torch.empty(0)), {})
    assert first_batch_difference([base, flipped], (0, 1)) == (
        "argument args[1] differs between ranks 0 and 1: its values differ (checksums)"
    )
    strided = batch_fingerprint((x.view(2, 3).t().contiguous().t(), mask, torch.empty(0)), {})  # same values
    assert strided[0][3] == base[0][3]
