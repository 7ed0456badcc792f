"""Pipeline parallelism, DeepSpeed's ``deepspeed.pipe``: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``;
schedules as pure generators of instructions (``schedule.py``, ``instructions.py``), their interpreter
(``executor.py``) and the pipeline engine's ``train_batch`` / ``eval_batch`` (``engine.py``).

``from shardspeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec`` works like ``deepspeed.pipe``; so do
DeepSpeed's topologies (``ProcessTopology``, ``PipeDataParallelTopology``, ``PipeModelDataParallelTopology``).
"""

from shardspeed.pipe.module import PipelineModule
from shardspeed.pipe.spec import LayerSpec, TiedLayerSpec
from shardspeed.pipe.tied import TiedWeight
from shardspeed.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
    "TiedWeight",
]
