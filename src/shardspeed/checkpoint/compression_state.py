"""Error-feedback buffers of optimizers that own communication (1-bit Adam) in checkpoints.

[Note: error buffers in checkpoints] A compressor's worker and server errors differ on every data-parallel rank,
so they are not boxes of a global tensor like everything else here: each buffer ``key`` is stored as one tensor
``compression/<key>`` of shape (N, n), data rank r writing row r (N: the saving data-parallel world size). A load
at the same N gives each rank its own row back, so a resumed run equals an uninterrupted one bit for bit; at
another N the rows mean nothing (chunks follow the world size) and the buffers restart at zero with one warning,
as DeepSpeed does on every load. 0/1 Adam adds its local-phase rows here ([Note: 0/1 Adam between syncs in
checkpoints] in compression/zero_one_adam.py). The frozen-phase flags are not stored: they follow from the per-parameter
``step`` counts, which are saved with the optimizer's other states.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardspeed.checkpoint.store import CheckpointReader, CheckpointWriter

PREFIX = "compression/"
logger = logging.getLogger("shardspeed")


def _holder(optimizer: Any) -> Any:
    return optimizer if hasattr(optimizer, "compression_state_dict") else None


def write_compression_state(engine: Any, writer: CheckpointWriter) -> None:
    """This rank's row of every error buffer (nothing for ordinary optimizers or before the compressed phase)."""
    optimizer = _holder(engine.optimizer)
    if optimizer is None:
        return
    world, rank = engine.topology.data.size, engine.topology.data.rank
    for key, tensor in optimizer.compression_state_dict().items():
        flat = tensor.detach().reshape(-1)
        if flat.numel() == 0:  # an axis of size 1 keeps no error
            continue
        writer.add(PREFIX + key, (world, flat.numel()), rank * flat.numel(), flat.contiguous())


def verify_compression_state(engine: Any, reader: CheckpointReader, meta: dict[str, Any]) -> None:
    """Check this rank's row of every error buffer (present, crc32) before the load changes anything, as the load
    plan does for the other states; at another world size nothing is read, so nothing is checked."""
    if _holder(engine.optimizer) is None:
        return
    world, rank = engine.topology.data.size, engine.topology.data.rank
    if int(meta.get("dp_world_size", world)) != world:
        return
    for name in reader.names(PREFIX):
        n = reader.shape(name)[1]
        reader.verify_range(name, rank * n, (rank + 1) * n)


def read_compression_state(engine: Any, reader: CheckpointReader, meta: dict[str, Any]) -> None:
    """Give the optimizer its own rows back at the saving world size, else reset its buffers (one warning)."""
    optimizer = _holder(engine.optimizer)
    if optimizer is None:
        return
    names = reader.names(PREFIX)
    world, rank = engine.topology.data.size, engine.topology.data.rank
    saved_world = int(meta.get("dp_world_size", world))
    if names and saved_world != world:
        if engine.topology.global_rank == 0:
            logger.warning(
                "checkpoint saved at data-parallel world size %d, loading at %d: %s's compression error buffers are "
                "reset (they follow the world size; DeepSpeed resets them on every load); 0/1 Adam saved between syncs "
                "restarts from the last synchronized parameters",
                saved_world,
                world,
                type(optimizer).__name__,
            )
        optimizer.load_compression_state_dict({}, same_world=False)
        return
    state = {}
    for name in names:
        n = reader.shape(name)[1]
        state[name.removeprefix(PREFIX)] = reader.read_range(name, rank * n, (rank + 1) * n)
    optimizer.load_compression_state_dict(state, same_world=True)
