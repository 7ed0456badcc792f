"""shardspeed: DeepSpeed's training system as a pure-Python library on torch.distributed."""

from shardspeed.data import RepeatingLoader
from shardspeed.distributed import init_distributed
from shardspeed.engine import ShardSpeedEngine
from shardspeed.initialize import initialize
from shardspeed.topology import MeshShape, Topology

__version__ = "0.1.0"

__all__ = [
    "MeshShape",
    "RepeatingLoader",
    "ShardSpeedEngine",
    "Topology",
    "__version__",
    "init_distributed",
    "initialize",
]
