"""The training data loader ``shardspeed.initialize`` hands back: a torch DataLoader driven by the
world-size-independent :class:`GlobalIndexSampler`, delivered through a background prefetch thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from shardspeed.data.prefetch import PrefetchIterator
from shardspeed.data.sampler import GlobalIndexSampler


class ShardSpeedDataLoader:
    """This rank's micro-batches, in global order, one batch prefetched ahead (to ``device`` on CUDA).

    ``len()`` is the number of micro-batches this rank reads per epoch. Finishing an iteration moves on to the
    next epoch (the next ``iter()`` reshuffles); breaking out early and iterating again continues where the
    consumer stopped, so only one live iterator exists at a time: a new ``iter()`` closes the previous one.
    :meth:`state_dict` is the position the training loop has *received*, however far the prefetcher has read.
    """

    def __init__(
        self,
        dataset: Dataset,
        sampler: GlobalIndexSampler,
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        device: torch.device | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.device = device
        self.micro_batch_size = sampler.micro_batch_size
        self._torch_loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory,
            # A private generator: otherwise every iter() draws its worker base seed from the global RNG, and a
            # run resumed from a checkpoint (fresh iterator after the RNG was restored) would drift from an
            # uninterrupted one.
            generator=torch.Generator().manual_seed(sampler.seed),
        )
        self._live: PrefetchIterator | None = None
        self.post_process_func: Callable[[Any, dict[str, Any]], Any] | None = None
        """DeepSpeed's hook (``engine.set_data_post_process_func``): ``fn(batch, sampler state)`` for each delivered
        batch; with the difficulty sampler the state's ``current_difficulties`` are those of that batch."""

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def data_sampler(self) -> Any:
        """DeepSpeed's name for the loader's batch sampler (its engine reaches the difficulty sampler through it)."""
        return self.sampler

    def __iter__(self) -> Iterator[Any]:
        if self._live is not None:
            self._live.close()
        self._live = PrefetchIterator(
            iter(self._torch_loader),
            device=self.device,
            on_delivered=self.sampler.advance,
            on_exhausted=self.sampler.start_next_epoch,
            post_process=self._post_process,
        )
        return self._live

    def _post_process(self, batch: Any) -> Any:
        fn = self.post_process_func
        if fn is None:
            return batch
        state = getattr(self.sampler, "delivery_state", self.sampler.state_dict)()
        return fn(batch, state)

    def close(self) -> None:
        """Stop the prefetch thread of the live iterator, if any."""
        if self._live is not None:
            self._live.close()
            self._live = None

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position; the next ``iter()`` starts there (a live iterator is closed first)."""
        self.close()
        self.sampler.load_state_dict(state)


def _non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def build_dataloader(
    dataset: Dataset,
    *,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    dp_rank: int,
    dp_world_size: int,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    seed: int = 0,
    shuffle: bool = True,
    num_workers: int = 0,
    device: torch.device | None = None,
    pin_memory: bool | None = None,
) -> ShardSpeedDataLoader:
    """A loader yielding this data-parallel rank's micro-batches of ``dataset``.

    ``dataset`` needs ``__len__`` and ``__getitem__``. ``pin_memory`` defaults to True exactly when ``device``
    is a CUDA device (pinned host memory is what lets the prefetch copy run asynchronously). Raises
    ValueError naming the argument when a size is invalid or the dataset is empty; a dataset smaller than one
    global batch is padded to one by repeating samples, with a warning (``GlobalIndexSampler``).
    """
    try:
        num_samples = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"dataset must be a map-style dataset with __len__ and __getitem__, got {type(dataset).__name__}"
        ) from None
    sampler = GlobalIndexSampler(
        num_samples,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seed=seed,
        shuffle=shuffle,
    )
    if device is not None:
        device = torch.device(device)
    if pin_memory is None:
        pin_memory = device is not None and device.type == "cuda"
    return ShardSpeedDataLoader(
        dataset,
        sampler,
        collate_fn=collate_fn,
        num_workers=_non_negative_int("num_workers", num_workers),
        device=device,
        pin_memory=pin_memory,
    )
