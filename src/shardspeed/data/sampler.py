"""World-size-independent sample order: which micro-batch of which global batch each data-parallel rank reads.

The order of samples is a property of the *run* (dataset, seed, epoch), never of how many ranks train it:
epoch ``e`` visits ``torch.randperm(len(dataset))`` drawn from ``torch.Generator().manual_seed(seed + e)``
(or ``range(len(dataset))`` without shuffling), cut into consecutive global batches of ``train_batch_size``
samples. Inside a global batch the samples are laid out micro-step by micro-step, and inside a micro-step rank
by rank::

    global batch = [step 0: rank 0 | rank 1 | ... | step 1: rank 0 | rank 1 | ... ]

so concatenating every rank's micro-batches in (micro-step, rank) order reproduces the global batch. Two runs
with the same global batch size but different ``micro_batch_size × gradient_accumulation_steps × world size``
factorisations therefore train on exactly the same global batches, and a checkpoint taken at one world size
resumes at another on the very next sample.

The tail of an epoch that does not fill a whole global batch is dropped (``drop_last`` for the *global*
batch): a partial global batch would give some ranks fewer micro-batches than others, and the ranks' gradient
all-reduces would then no longer line up. A dataset smaller than one global batch is the exception: rather than
an empty epoch, its order is repeated to fill exactly one global batch (with a warning), as DeepSpeed's
DistributedSampler pads.

The position is kept in global samples consumed within the epoch (plus epoch and seed), not in per-rank
indices, because only that number means the same thing at every world size.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from shardspeed.log import logger


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class GlobalIndexSampler:
    """Batch sampler yielding this rank's micro-batches (lists of dataset indices) in global order.

    Iterating does not move the position: readers such as DataLoader workers or a prefetch thread run ahead of
    what the training loop has actually consumed, so the loader that delivers batches reports progress with
    :meth:`advance` and :meth:`start_next_epoch`. Each ``iter()`` starts at the current position, which is
    what makes a restored :meth:`state_dict` continue where the checkpoint left off.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        micro_batch_size: int,
        gradient_accumulation_steps: int,
        dp_rank: int,
        dp_world_size: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
            raise ValueError(f"num_samples must be a non-negative integer, got {num_samples!r}")
        self.micro_batch_size = _positive_int("micro_batch_size", micro_batch_size)
        self.gradient_accumulation_steps = _positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
        self.dp_world_size = _positive_int("dp_world_size", dp_world_size)
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank must be an integer in [0, {dp_world_size}), got {dp_rank!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.dp_rank = dp_rank
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.train_batch_size = self.micro_batch_size * self.gradient_accumulation_steps * self.dp_world_size
        if num_samples == 0:
            raise ValueError("the dataset is empty (0 samples): there is nothing to train on")
        if num_samples < self.train_batch_size:
            # [Note: dataset smaller than one global batch] DeepSpeed runs it (its DistributedSampler pads by
            # repeating samples); refusing broke tiny smoke-test datasets. We pad the same way, up to exactly one
            # global batch, so every rank still reads the same number of full micro-batches (the gradient
            # all-reduces line up and the mean is over train_batch_size samples, as always).
            logger.warning(
                f"the dataset has {num_samples} samples, fewer than one global batch (train_batch_size = "
                f"micro_batch_size {self.micro_batch_size} × gradient_accumulation_steps "
                f"{self.gradient_accumulation_steps} × data-parallel world size {self.dp_world_size} = "
                f"{self.train_batch_size}); each epoch is one global batch that repeats samples to fill it"
            )
        self.epoch = 0
        self.samples_consumed_in_epoch = 0

    # ---- geometry -------------------------------------------------------------------------------------
    @property
    def samples_per_micro_step(self) -> int:
        """Global samples consumed when every rank takes one micro-batch."""
        return self.micro_batch_size * self.dp_world_size

    @property
    def global_batches_per_epoch(self) -> int:
        """At least one: a dataset smaller than one global batch is padded to one (see the note above)."""
        return max(1, self.num_samples // self.train_batch_size)

    @property
    def samples_per_epoch(self) -> int:
        """Samples actually visited per epoch (the incomplete last global batch is dropped)."""
        return self.global_batches_per_epoch * self.train_batch_size

    def __len__(self) -> int:
        """Micro-batches this rank reads in a full epoch."""
        return self.global_batches_per_epoch * self.gradient_accumulation_steps

    # ---- order ------------------------------------------------------------------------------------------
    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The global sample order of ``epoch``: identical on every rank and at every world size."""
        if not self.shuffle:
            order = torch.arange(self.num_samples)
        else:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=generator)
        if self.num_samples < self.train_batch_size:  # padded by cycling the order, as DistributedSampler pads
            order = order.repeat(-(-self.train_batch_size // self.num_samples))[: self.train_batch_size]
        return order

    def __iter__(self) -> Iterator[list[int]]:
        # Bind the position now, not at the generator's first next(): the loader may advance it meanwhile.
        return self._rank_micro_batches(self.epoch, self.samples_consumed_in_epoch)

    def _rank_micro_batches(self, epoch: int, start: int) -> Iterator[list[int]]:
        order = self.epoch_order(epoch)
        rank_offset = self.dp_rank * self.micro_batch_size
        for step_start in range(start, self.samples_per_epoch, self.samples_per_micro_step):
            first = step_start + rank_offset
            yield order[first : first + self.micro_batch_size].tolist()

    # ---- position -------------------------------------------------------------------------------------
    def advance(self, micro_steps: int = 1) -> None:
        """Record that every rank has consumed ``micro_steps`` more micro-batches."""
        self.samples_consumed_in_epoch += micro_steps * self.samples_per_micro_step

    def start_next_epoch(self) -> None:
        self.epoch += 1
        self.samples_consumed_in_epoch = 0

    def state_dict(self) -> dict[str, Any]:
        if self.samples_consumed_in_epoch >= self.samples_per_epoch:
            # Everything of this epoch was delivered but the consumer has not yet seen the end: the next
            # sample is the first of the next epoch.
            return self._state(self.epoch + 1, 0)
        return self._state(self.epoch, self.samples_consumed_in_epoch)

    def _state(self, epoch: int, consumed: int) -> dict[str, Any]:
        return {
            "epoch": epoch,
            "samples_consumed_in_epoch": consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "train_batch_size": self.train_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position, possibly saved at another world size.

        The saved seed and shuffle flag win over this sampler's own: they define the order the run was
        following. ``train_batch_size`` is informational; if it changed, the next sample is still the same
        one, but where global batches begin follows the new size.
        """
        for key in ("epoch", "samples_consumed_in_epoch", "seed", "shuffle", "num_samples"):
            if key not in state:
                raise ValueError(f"sampler state is missing {key!r}; got keys {sorted(state)}")
        if state["num_samples"] != self.num_samples:
            raise ValueError(
                f"sampler state was saved for a dataset of {state['num_samples']} samples but this dataset "
                f"has {self.num_samples}; the sample order would differ, so the position cannot be restored"
            )
        epoch, consumed = int(state["epoch"]), int(state["samples_consumed_in_epoch"])
        if epoch < 0 or consumed < 0:
            raise ValueError(f"sampler state has a negative position: epoch {epoch}, samples {consumed}")
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        if consumed >= self.samples_per_epoch:
            epoch, consumed = epoch + 1, 0
        if consumed % self.samples_per_micro_step:
            raise ValueError(
                f"sampler state position {consumed} (samples consumed in epoch {epoch}) is not a whole "
                f"number of micro-steps for micro_batch_size {self.micro_batch_size} × data-parallel world "
                f"size {self.dp_world_size} = {self.samples_per_micro_step} samples; resume from a "
                f"checkpoint taken at an optimizer-step boundary"
            )
        self.epoch, self.samples_consumed_in_epoch = epoch, consumed
