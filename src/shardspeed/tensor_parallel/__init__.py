"""Tensor parallelism (Megatron-style slicing): the layers' context (``context.py``), the mappings (``mappings.py``),
the layers (``layers.py``), sequence parallelism (``sequence.py``), partial gradients (``partial_grads.py``) and the
expected traffic per block (``traffic.py``)."""

from shardspeed.tensor_parallel.context import TensorParallel, bind_collectives, tensor_parallel_contexts
from shardspeed.tensor_parallel.partial_grads import register_partial_grad_hooks

__all__ = ["TensorParallel", "bind_collectives", "register_partial_grad_hooks", "tensor_parallel_contexts"]
