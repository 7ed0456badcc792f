"""``deepspeed.pipe`` (PipelineModule, LayerSpec, TiedLayerSpec): pipeline parallelism is not implemented yet.

Importing this package raises ImportError with that reason — not ModuleNotFoundError, which would read as a broken
installation — so ``from shardspeed.pipe import PipelineModule`` fails at the import line with the real cause.
"""

raise ImportError(
    "shardspeed.pipe: pipeline parallelism (DeepSpeed's deepspeed.pipe: PipelineModule, LayerSpec, TiedLayerSpec, "
    "engine.train_batch) is not implemented yet in shardspeed; see the 'true drop-in' issue's pipeline item. "
    "Data parallelism with ZeRO stages 0-3 and offload is available through shardspeed.initialize"
)
