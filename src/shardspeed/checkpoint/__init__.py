"""Checkpoints: rank-agnostic, crash-safe, checksummed, loadable at any world size and ZeRO stage, never pickled.

Module map: ``index`` (the JSON schema of ``index.json``/``metadata.json`` and the errors), ``store``
(``CheckpointWriter`` per rank, ``CheckpointReader`` with ranged, checksum-verified reads),
``safetensors_file`` (streaming safetensors writer), ``commit`` (crash-safe publish, ``latest``, tag
resolution, stale temporary directories), ``consolidate`` (``shardspeed zero-to-fp32`` and the fp32 state-dict
helpers), ``boxes`` (pure: tensors stored as boxes of their global shape, flat ranges of boxes) and ``box_io`` (a
rank's local parameter range ↔ those boxes). The engine's save/load on top of these lives in ``engine_io``
(``load_plan``: verify, then read; ``agreement``: every rank raises when a save or load failed on any rank).
"""

from __future__ import annotations

from shardspeed.checkpoint.agreement import CheckpointWriteError
from shardspeed.checkpoint.commit import (
    cleanup_stale_tmp,
    commit_checkpoint,
    list_tags,
    make_tmp_dir,
    read_latest,
    resolve_tag,
)
from shardspeed.checkpoint.consolidate import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from shardspeed.checkpoint.index import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointKeyError,
    CheckpointNotFoundError,
    CheckpointTilingError,
)
from shardspeed.checkpoint.store import CheckpointReader, CheckpointWriter

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointKeyError",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "CheckpointTilingError",
    "CheckpointWriteError",
    "CheckpointWriter",
    "cleanup_stale_tmp",
    "commit_checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "list_tags",
    "load_state_dict_from_zero_checkpoint",
    "make_tmp_dir",
    "read_latest",
    "resolve_tag",
]
