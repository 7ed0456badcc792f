"""The reset / init_fn random-number schedule of zero.Init materialization ([Note: random-number schedule] in
materialize.py): a survey pass in the normal build's order records the generator state before each call."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch


def has_reset(module: torch.nn.Module) -> bool:
    return callable(getattr(module, "reset_parameters", None))


class RngSchedule:
    """Generator states recorded by a survey pass; see [Note: random-number schedule] in materialize.py.

    ``modules``: the materializer's entries (``.module``, ``.init_fn``, ``.replayed``: no reset when recorded)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.states: dict[tuple[str, int], torch.Tensor] = {}
        self.final: torch.Tensor | None = None

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @classmethod
    def survey(
        cls,
        modules: Sequence[Any],
        device: torch.device,
        scratch: Callable[[torch.nn.Module], contextlib.AbstractContextManager[None]],
    ) -> RngSchedule:
        schedule = cls(device)
        for position, entry in enumerate(modules):
            if has_reset(entry.module) and not entry.replayed:
                schedule.states[("reset", position)] = schedule._get()
                with scratch(entry.module):
                    entry.module.reset_parameters()
        for position, entry in enumerate(modules):
            if entry.init_fn is not None:
                schedule.states[("init", position)] = schedule._get()
                with scratch(entry.module):
                    entry.init_fn(entry.module)
        schedule.final = schedule._get()
        return schedule

    def restore(self, key: tuple[str, int]) -> None:
        self._set(self.states.pop(key))

    def restore_final(self) -> None:
        assert self.final is not None
        self._set(self.final)
