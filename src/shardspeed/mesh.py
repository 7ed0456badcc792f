"""Mesh resolution: how many ranks each parallel axis gets, decided before the config's batch arithmetic.

``train_batch_size = micro × GAS × DP`` needs DP, and DP is what is left of the world once the tensor and pipeline
axes took theirs: DP = world / (TP × PP). So ``initialize`` resolves the mesh first, from what the job says about
the model-parallel axes, then builds the topology and only then parses the config for that DP.

[Note: where the mesh comes from] Three sources, each optional:
- ``tensor_parallel.autotp_size`` in the raw config (DeepSpeed's AutoTP; 0, 1 or absent: no tensor axis), read
  from the raw dict / JSON path the way ``faults/startup.early_fault_config`` reads ``fault_tolerance`` — the
  typed config cannot be built yet, it needs DP;
- an ``mpu`` (Megatron's interface, or a shardspeed ``Topology``): its tensor and pipeline sizes;
- a pipeline module: its stage count (``pipeline_stages``) sets ``pipe``, checked against an mpu's pipeline size
  and against the config's ``pipeline.stages`` when that is a number (``"auto"``, DeepSpeed's default, defers to
  the module). ``pipeline.stages`` alone never creates a pipe axis: a model that is not a ``PipelineModule``
  cannot be split into stages, and DeepSpeed ignores the key for it too.
When two sources name the same axis they must agree; every disagreement, and a world the model-parallel axes do
not divide, is a ``MeshError`` naming the numbers. The function is pure and reads the same config and mpu on every
rank, so the error is the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardspeed.faults.errors import mark_agreed
from shardspeed.topology import AXES, MeshShape

__all__ = [
    "MeshError",
    "MpuRecord",
    "autotp_size_of",
    "config_pipeline_stages",
    "grid_from_mpu_records",
    "resolve_mesh",
]


class MeshError(ValueError):
    """The parallel axes requested by the config / mpu do not fit the world (or each other)."""


def autotp_size_of(raw_config: Any) -> int:
    """``tensor_parallel.autotp_size`` of a raw config (dict or JSON path); 1 when absent, 0 or 1. A config that
    cannot be read at all counts as "no tensor parallelism": ``load_config`` reports it properly afterwards."""
    from shardspeed.config.load import read_config_source

    try:
        raw = read_config_source(raw_config)
    except Exception:
        return 1
    section = raw.get("tensor_parallel")
    if section is None:
        return 1
    if not isinstance(section, dict):
        raise MeshError(f"tensor_parallel must be a JSON object, got {section!r}")
    size = section.get("autotp_size", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise MeshError(f"tensor_parallel.autotp_size must be a non-negative integer, got {size!r}")
    return max(size, 1)


def config_pipeline_stages(raw_config: Any) -> int | None:
    """``pipeline.stages`` of a raw config (dict or JSON path) when it is a number; None when absent, ``"auto"``
    or the config cannot be read (``load_config`` reports bad values properly afterwards)."""
    from shardspeed.config.load import read_config_source

    try:
        raw = read_config_source(raw_config)
    except Exception:
        return None
    section = raw.get("pipeline") if isinstance(raw, dict) else None
    if not isinstance(section, dict):
        return None
    stages = section.get("stages", "auto")
    if isinstance(stages, float) and stages.is_integer():
        stages = int(stages)
    if stages == "auto":
        return None
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise MeshError(f'pipeline.stages must be "auto" or a positive integer, got {stages!r}')
    return stages


def _mpu_size(mpu: Any, *getters: str) -> int | None:
    """The first of ``getters`` that ``mpu`` has, called; None if it has none of them (an mpu without a
    pipeline axis, say)."""
    for name in getters:
        getter = getattr(mpu, name, None)
        if getter is not None:
            return int(getter())
    return None


def resolve_mesh(raw_config: Any, world_size: int, mpu: Any = None, pipeline_stages: int | None = None) -> MeshShape:
    """The mesh shape for ``world_size`` ranks ([Note: where the mesh comes from]). Pure: no process group needed.

    ``pipeline_stages``: a pipeline module's stage count (None: not a pipeline module). Raises ``MeshError`` naming
    the numbers when the world is not divisible by TP × PP, when ``autotp_size`` disagrees with the mpu's tensor
    size, when the module's stage count disagrees with the mpu's pipeline size or a numeric ``pipeline.stages``,
    or when the mpu's data × tensor × pipe is not the world.
    """
    if world_size < 1:
        raise MeshError(f"world size must be >= 1, got {world_size}")
    autotp = autotp_size_of(raw_config)
    tensor, pipe = autotp, 1
    mpu_pipe = 1
    if mpu is not None:
        mpu_tensor = _mpu_size(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size") or 1
        mpu_pipe = _mpu_size(mpu, "get_pipeline_model_parallel_world_size") or 1
        if autotp > 1 and autotp != mpu_tensor:
            raise MeshError(
                f"tensor_parallel.autotp_size is {autotp} but the mpu's tensor-parallel world size is {mpu_tensor}: "
                "they name the same axis and must agree (or drop autotp_size and let the mpu decide)"
            )
        tensor, pipe = mpu_tensor, mpu_pipe
    if pipeline_stages is not None:
        pipe = _pipeline_pipe(raw_config, pipeline_stages, mpu_pipe if mpu is not None else None)
    model_parallel = tensor * pipe
    if world_size % model_parallel:
        source = "the mpu" if mpu is not None else "tensor_parallel.autotp_size"
        if pipeline_stages is not None:
            source += " and the pipeline module's stages"
        raise MeshError(
            f"world size {world_size} is not divisible by tensor {tensor} × pipe {pipe} = {model_parallel} "
            f"(from {source}): the data-parallel size would not be a whole number"
        )
    data = world_size // model_parallel
    if mpu is not None:
        mpu_data = _mpu_size(mpu, "get_data_parallel_world_size")
        if mpu_data is not None and mpu_data != data:
            raise MeshError(
                f"the mpu's data-parallel world size {mpu_data} × tensor {tensor} × pipe {pipe} = "
                f"{mpu_data * model_parallel} does not match the world size {world_size}"
            )
    return MeshShape(pipe=pipe, data=data, tensor=tensor)


def _pipeline_pipe(raw_config: Any, stages: int, mpu_pipe: int | None) -> int:
    """The pipe size of a pipeline module with ``stages`` stages, checked against the mpu and ``pipeline.stages``."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise MeshError(f"a pipeline module's stage count must be a positive integer, got {stages!r}")
    configured = config_pipeline_stages(raw_config)
    if configured is not None and configured != stages:
        raise MeshError(
            f'pipeline.stages is {configured} but the pipeline module has {stages} stages: set "stages" to {stages} '
            'or "auto"'
        )
    if mpu_pipe is not None and mpu_pipe != stages:
        raise MeshError(
            f"the pipeline module has {stages} stages but the mpu's pipeline-parallel world size is {mpu_pipe}: "
            "they name the same axis and must agree"
        )
    return stages


# --- a foreign mpu's layout, checked as one grid (Topology.from_mpu gathers the records) ------------------------
@dataclass(frozen=True)
class MpuRecord:
    """What one rank's mpu says: its (pipe, data, tensor) indices and each axis group's members (global ranks)."""

    coords: tuple[int, int, int]
    ranks: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def grid_from_mpu_records(records: list[Any]) -> tuple[MeshShape, tuple[int, ...]]:
    """Pure: check that every rank's (pipe, data, tensor) indices and groups form one full grid; return the mesh
    shape and the layout (global ranks in (pipe, data, tensor) row-major order). ``records[r]`` is global rank
    r's ``MpuRecord`` (or the text of its error). Raises ``MeshError`` naming the rank and the disagreement."""

    def fail(text: str) -> MeshError:
        return mark_agreed(MeshError(f"mpu layout: {text}"))  # type: ignore[return-value]

    for r, rec in enumerate(records):
        if not isinstance(rec, MpuRecord):
            raise fail(f"rank {r}: {rec}")
    sizes = tuple(len(ranks) for ranks in records[0].ranks)
    for r, rec in enumerate(records):
        mine = tuple(len(ranks) for ranks in rec.ranks)
        if mine != sizes:
            raise fail(
                f"rank {r} has group sizes (pipe, data, tensor) = {mine} but rank 0 has {sizes}: every rank's mpu "
                "must describe the same mesh"
            )
    shape = MeshShape(pipe=sizes[0], data=sizes[1], tensor=sizes[2])
    if shape.world_size != len(records):
        raise fail(
            f"pipe {shape.pipe} × data {shape.data} × tensor {shape.tensor} = {shape.world_size} does not match "
            f"the world size {len(records)}"
        )
    at: dict[tuple[int, int, int], int] = {}
    for r, rec in enumerate(records):
        if rec.coords in at:
            raise fail(f"ranks {at[rec.coords]} and {r} both claim (pipe, data, tensor) indices {rec.coords}")
        at[rec.coords] = r
    for r, rec in enumerate(records):
        for i, axis in enumerate(AXES):
            # the group along ``axis``: the ranks whose other indices equal this rank's, in their ``axis`` order
            expected = []
            for k in range(sizes[i]):
                coords = list(rec.coords)
                coords[i] = k
                expected.append(at[tuple(coords)])  # type: ignore[index]
            if tuple(expected) != rec.ranks[i]:
                raise fail(
                    f"rank {r}'s {axis} group is {list(rec.ranks[i])}, but the ranks sharing its other indices, in "
                    f"{axis}-index order, are {expected}: the groups do not form a (pipe, data, tensor) grid"
                )
    layout = tuple(at[(p, d, t)] for p in range(shape.pipe) for d in range(shape.data) for t in range(shape.tensor))
    return shape, layout
