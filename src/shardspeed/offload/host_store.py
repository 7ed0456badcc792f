"""``HostStore``: the swapper's interface over tensors kept in (pinned, with an accelerator) host memory.

``offload_optimizer`` / ``offload_param`` with ``device: "cpu"`` on a machine with an accelerator keep their
tensors here; the streamed optimizer and the parameter offloader treat it like a swap file that never waits.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .swapper import SwapHandle


class StateStore(Protocol):
    """What the streamed optimizer needs of a store: named 1-D tensors written and read asynchronously."""

    def swap_out(self, name: str, tensor: torch.Tensor) -> SwapHandle: ...

    def swap_in(self, name: str, out: torch.Tensor) -> SwapHandle: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class DoneHandle:
    """A finished operation (host copies are synchronous); ``wait`` returns the tensor like ``SwapHandle``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self) -> torch.Tensor:
        return self._tensor

    def done(self) -> bool:
        return True


class HostStore:
    """Tensors in (pinned, when an accelerator is present) host memory, with the swapper's interface."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory and torch.cuda.is_available()  # pinning needs an accelerator runtime
        self._tensors: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def swap_out(self, name: str, tensor: torch.Tensor) -> SwapHandle:
        held = self._tensors.get(name)
        if held is None or held.numel() != tensor.numel():
            held = torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=self.pin_memory)
            self._tensors[name] = held
        held.copy_(tensor.view(-1))
        return DoneHandle(tensor)  # type: ignore[return-value]

    def swap_in(self, name: str, out: torch.Tensor) -> SwapHandle:
        if name not in self._tensors:
            raise KeyError(f"swap_in({name!r}): nothing stored under that name")
        out.view(-1).copy_(self._tensors[name])
        return DoneHandle(out)  # type: ignore[return-value]

    def held(self, name: str) -> torch.Tensor:
        """The tensor stored under ``name`` (pinned when ``pin_memory``), for a caller that copies it to a device
        asynchronously itself (param_offload.py: [Note: asynchronous host-to-device copies])."""
        if name not in self._tensors:
            raise KeyError(f"held({name!r}): nothing stored under that name")
        return self._tensors[name]

    def flush(self) -> None:
        return None

    def close(self) -> None:
        self._tensors.clear()
