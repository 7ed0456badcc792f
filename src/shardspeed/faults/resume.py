"""Automatic resume (``fault_tolerance.auto_resume``): at ``initialize``, continue from ``checkpoint_dir``'s latest.

An elastic restart (torchrun ``--max-restarts``, ``shardspeed --max_restarts``) runs the same script again from
the top; with ``auto_resume`` the engine it builds loads the latest checkpoint before returning, so an unmodified
loop that counts from ``engine.global_steps`` continues where the last save left off. ``load_checkpoint`` restores
everything a bit-exact continuation needs: parameters, optimizer and LR-scheduler states, the loss scaler, the
counters, the engine data loader's position (``training_data=``) and every rank's Python / NumPy / torch RNG states
and model-parallel RNG trackers (so dropout, tensor-parallel regions included, draws the same masks). A script that
iterates its own DataLoader must put that position back itself: see README ("Preemption and elastic restarts").

Whether ``latest`` exists is agreed across the whole world first (every rank of every axis — data, tensor, pipe —
must take the same branch): a rank that sees a checkpoint its peers do not (a directory that is not shared) would
otherwise load alone and wait in a collective the others skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from shardspeed.symmetric import check_same_on_all_ranks

if TYPE_CHECKING:
    from shardspeed.config.fault_tolerance import FaultToleranceConfig
    from shardspeed.engine import ShardSpeedEngine

__all__ = ["resume_latest"]


def resume_latest(engine: ShardSpeedEngine, config: FaultToleranceConfig) -> Path | None:
    """With ``auto_resume``, load ``checkpoint_dir``'s latest checkpoint into ``engine`` (collective: every rank
    calls it) and return its path; None when ``auto_resume`` is off or there is nothing to resume from yet."""
    if not config.auto_resume:
        return None
    if not config.checkpoint_dir:
        raise ValueError("fault_tolerance.auto_resume is true but fault_tolerance.checkpoint_dir is not set")
    directory = Path(config.checkpoint_dir)
    found = (directory / "latest").is_file()
    # No path in the text: the error must read the same on every rank, whatever each rank's checkpoint_dir.
    what = "whether checkpoint_dir/latest exists (fault_tolerance.auto_resume; is checkpoint_dir shared?)"
    check_same_on_all_ranks(found, engine.topology.world, engine.collectives, what=what)
    rank0 = engine.topology.global_rank == 0
    if not found:
        if rank0:
            engine.logger.info("auto_resume: no checkpoint in %s yet; starting from step 0", directory)
        return None
    path, _ = engine.load_checkpoint(str(directory))
    assert path is not None
    if rank0:
        engine.logger.info(
            "auto_resume: resumed from %s (step %d, %d samples)", path, engine.global_steps, engine.global_samples
        )
    return Path(path)
