"""Which stage reads data, and how a batch becomes a micro-batch's inputs and labels.

Batches are ``(inputs, labels)`` pairs, as DeepSpeed's pipeline engine expects. Only the first virtual stage
needs the inputs and only the last the labels, so only those stages call ``next()`` on their iterator, once per
micro-batch (a stage holding both reads each batch once). A middle stage never touches data: it may have no
iterator at all. Every pipeline reads its own data-parallel rank's micro-batches; the stages of one pipeline must
therefore be given iterators over the same sequence (the engine's loader is built per data-parallel rank, so it
is).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from shardspeed.precision.autocast import cast_floats

__all__ = ["StageData", "as_tuple", "to_device"]


def to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def as_tuple(obj: Any, what: str) -> tuple[tuple[torch.Tensor, ...], bool]:
    """``(tensors, single)``: a tensor or a tuple/list of tensors between stages (``single``: it was one tensor)."""
    if isinstance(obj, torch.Tensor):
        return (obj,), True
    if isinstance(obj, (tuple, list)) and obj and all(isinstance(t, torch.Tensor) for t in obj):
        return tuple(obj), False
    kinds = type(obj).__name__ if not isinstance(obj, (tuple, list)) else [type(t).__name__ for t in obj]
    raise TypeError(
        f"{what} must be a tensor or a non-empty tuple of tensors (what passes between pipeline stages), got {kinds}"
    )


class StageData:
    """This stage's view of the data iterator: inputs on the first virtual stage, labels on the last."""

    def __init__(
        self,
        iterator: Iterator[Any] | None,
        *,
        reads_inputs: bool,
        reads_labels: bool,
        device: torch.device,
        cast_dtype: torch.dtype | None = None,
        on_load: Callable[[Any, Any], None] | None = None,
    ) -> None:
        self.iterator = iterator
        self.on_load = on_load  # the engine's first-batch check over the tensor axis
        self.reads_inputs = reads_inputs
        self.reads_labels = reads_labels
        self.device = device
        self.cast_dtype = cast_dtype  # fp16.auto_cast's compute dtype; None: inputs are the model's business
        self.batches_read = 0

    @property
    def needed(self) -> bool:
        return self.reads_inputs or self.reads_labels

    def load(self, micro_batch: int) -> tuple[Any, Any]:
        """``(inputs, labels)`` of the next batch; the half this stage does not use is None."""
        if self.iterator is None:
            raise ValueError(
                "train_batch()/eval_batch() on the first or last pipeline stage needs data: pass data_iter, call "
                "set_dataiterator(), or give initialize() training_data"
            )
        try:
            batch = next(self.iterator)
        except StopIteration:
            raise StopIteration(
                f"the data iterator ran out at micro-batch {micro_batch} (each train_batch reads "
                "gradient_accumulation_steps batches; wrap it in shardspeed.data.RepeatingLoader)"
            ) from None
        self.batches_read += 1
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(
                "pipeline batches must be (inputs, labels) pairs, as in DeepSpeed's PipelineEngine; got "
                f"{type(batch).__name__}{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}"
            )
        inputs, labels = batch
        if self.reads_inputs:
            inputs = to_device(inputs, self.device)
            # As the base engine's forward (engine.py): float inputs are cast only under fp16.auto_cast — never
            # otherwise, since a float mask or additive bias (−1e9) may be meant to stay fp32 (−inf in fp16).
            # DeepSpeed's pipeline engine does not cast at all; the first stage's layers own their inputs' dtype.
            if self.cast_dtype is not None:
                inputs = cast_floats(inputs, self.cast_dtype)
        inputs = inputs if self.reads_inputs else None
        labels = to_device(labels, self.device) if self.reads_labels else None
        if self.on_load is not None:
            self.on_load(inputs, labels)
        return inputs, labels
