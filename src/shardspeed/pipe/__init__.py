"""Pipeline parallelism, DeepSpeed's ``deepspeed.pipe``: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``;
schedules as pure generators of instructions (``schedule.py``, ``instructions.py``), their interpreter
(``executor.py``) and the pipeline engine's ``train_batch`` / ``eval_batch`` (``engine.py``)."""
