"""Tensor parallelism (Megatron-style slicing): the layers' context (``context.py``)."""

from shardspeed.tensor_parallel.context import TensorParallel, bind_collectives, tensor_parallel_contexts

__all__ = ["TensorParallel", "bind_collectives", "tensor_parallel_contexts"]
