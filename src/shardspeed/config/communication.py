"""``communication``: shardspeed's own section (not a DeepSpeed key): how the engine's collectives are carried out.

[Note: collective algorithms] The same collective can be carried by different torch.distributed calls whose cost
depends on the backend, not on the bytes: on gloo a reduce-scatter runs as an all-reduce underneath (so
all-reduce-then-slice costs the same and needs no output copy), and an all-gather is several times slower than
one broadcast per owner for the same bytes. Which call wins is measured, not assumed from the backend's name:
see ``shardspeed/comm/algorithms.py`` (the full reasoning, the decision rule, the measured table and the bucket
knee) and ``comm/calibrate.py`` ([Note: agreed calibration]). NCCL always gets its native ops. Unset
``zero_optimization.reduce_bucket_size`` / ``allgather_bucket_size`` default to the knee of the measured bandwidth
curve (``engine_setup.bucket_defaults``).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from .base import ConfigModel


class SimulatedLinkConfig(ConfigModel):
    """``communication.simulated_link``: a SIMULATION for benchmarks, not a network setting. Every logged
    collective completes only after its algorithmic bytes would have crossed a link of this bandwidth plus the
    latency, counted from its launch ([Note: simulated link] in comm/simulated_link.py)."""

    bandwidth_gbps: float = Field(gt=0)
    """The simulated link's bandwidth in Gbit/s (per rank, per call)."""

    latency_us: float = Field(default=0.0, ge=0)
    """Added to every call, in microseconds."""


class CommunicationConfig(ConfigModel):
    """``communication``: the algorithm behind each collective and the default bucket sizes."""

    AUTO_IS_VALUE: ClassVar[frozenset[str]] = frozenset({"collectives"})  # "auto" is a value, not HF's placeholder

    collectives: Literal["auto", "native", "calibrate"] = "auto"
    """``"native"``: torch's call for every collective. ``"auto"`` (default): NCCL native; gloo per the measured
    choice cached for this host, data-axis size, dtype and device type if every rank holds the same one, else the
    documented table in ``comm/algorithms.py``. ``"calibrate"``: gloo measures at start-up when no agreed cached
    choice exists (world rank 0 decides, broadcasts, logs and caches it), then behaves as ``"auto"``. Applied to
    data-axis collectives only; tensor / pipe axes always run native."""

    calibration_cache: str | None = None
    """Directory of cached calibrations (one JSON file per backend, axis size, dtype, device type, host and torch
    version). Default: ``$SHARDSPEED_CACHE_DIR`` or ``~/.cache/shardspeed``. A corrupt file is ignored with a
    warning."""

    simulated_link: SimulatedLinkConfig | None = None
    """Off (None) by default. ``{"bandwidth_gbps": 1.0, "latency_us": 50}`` makes every collective wait out a
    SIMULATED link of that speed (benchmarks of communication-bound training on fast hosts); never for real runs."""
