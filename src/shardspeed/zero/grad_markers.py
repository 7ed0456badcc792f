"""What a trainable parameter's ``.grad`` holds between backward passes, so torch's own ``zero_grad`` works.

[Note: gradient markers] The stage keeps gradients in its own buffers (flat buffer, shards, staging), not in
``param.grad``; a script's ``module.zero_grad()`` / ``optimizer.zero_grad()`` only touches ``.grad``. So between
backward passes every trainable parameter's ``.grad`` is a *marker* the engine can check later, without patching
anything in torch:
- stages 0/1 in fp32: the flat gradient buffer's view (autograd accumulates into it in place); a user
  ``zero_()`` zeroes the buffer itself, ``set_to_none`` leaves ``None`` behind;
- otherwise a 0-stride sentinel ``torch.zeros((), dtype).expand(shape)`` (one element, a few bytes): a user
  ``zero_()`` bumps its version counter, ``set_to_none`` leaves ``None``.
A tensor pre-hook (runs before AccumulateGrad) sets ``.grad = None`` over a sentinel so autograd starts a fresh
gradient (AccumulateGrad would otherwise add into the 0-stride tensor); after the stage absorbed the gradient the
marker is installed again. ``cleared()`` lists the parameters whose marker user code removed or zeroed since:
their accumulated gradient is forgotten by the stage (each GradSync's / UnitGrads' ``forget``).
ZeRO-3: ``.grad`` must match the parameter's current shape when assigned, and between uses a parameter is an
empty placeholder, so a sentinel (full shape) is installed only as a gradient arrives (the unit is gathered then)
and removed at the step's zeroing: with nothing held there is nothing to clear.

``SteppedGrads`` does the same for the tensors the optimizer steps (masters, bucket slices, unit shards), whose
``.grad`` are views of the stage's reduced gradients: ``optimizer.zero_grad()`` sets them to ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class GradMarkers:
    def __init__(self, params: Sequence[torch.nn.Parameter], views: Sequence[torch.Tensor] | None = None) -> None:
        self.params = list(params)
        self.views = list(views) if views is not None else None
        self._sentinels: list[torch.Tensor | None] = [None] * len(self.params)
        self._versions = [0] * len(self.params)

    def set_views(self, views: Sequence[torch.Tensor] | None) -> None:
        """(Re)built buffers: markers for the new views. A gradient autograd left in ``.grad`` and not absorbed
        yet (the first backward's, replayed after the re-layout) is kept."""
        old = [self._marker(i) for i in range(len(self.params))]
        self.views = list(views) if views is not None else None
        for i, p in enumerate(self.params):
            if p.grad is None or p.grad is old[i] or self.views is not None:
                self.install(i)

    def _marker(self, i: int) -> torch.Tensor | None:
        return self.views[i] if self.views is not None else self._sentinels[i]

    def install(self, i: int) -> None:
        p = self.params[i]
        if self.views is not None:
            p.grad = self.views[i]
            return
        sentinel = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
        self._sentinels[i], self._versions[i] = sentinel, sentinel._version
        p.grad = sentinel

    def install_all(self) -> None:
        for i in range(len(self.params)):
            self.install(i)

    def uninstall(self, i: int) -> None:
        """No marker (ZeRO-3 while the parameter is an empty placeholder: a sentinel must have the parameter's
        full shape, which ``.grad`` cannot take then; the next gradient, arriving while it is gathered, installs
        one)."""
        if self.params[i].grad is self._sentinels[i]:
            self.params[i].grad = None
        self._sentinels[i] = None

    def uninstall_all(self) -> None:
        for i in range(len(self.params)):
            self.uninstall(i)

    def before_accumulate(self, i: int) -> None:
        """Tensor pre-hook: autograd is about to accumulate parameter i's gradient; a sentinel must not be added
        into (a user's own tensor is kept: torch semantics, the stage folds the sum in)."""
        if self.views is None and self._sentinels[i] is not None and self.params[i].grad is self._sentinels[i]:
            self.params[i].grad = None

    def cleared(self) -> list[int]:
        """Parameters whose marker user code removed (``set_to_none``) or zeroed in place since it was installed
        (in-place zeroing of a buffer view is not listed: it already zeroed the buffer)."""
        out = []
        for i, p in enumerate(self.params):
            g = p.grad
            if self.views is not None:
                if g is None or g.data_ptr() != self.views[i].data_ptr():
                    out.append(i)
                continue
            sentinel = self._sentinels[i]
            if sentinel is None:
                continue  # never installed (stage 3 before its first backward): nothing held
            if g is not sentinel or sentinel._version != self._versions[i]:
                out.append(i)
        return out


class SteppedGrads:
    """The optimizer's stepped tensors and the ``.grad`` the stage gave each; ``optimizer.zero_grad()`` (set to
    None) detaches them, in-place zeroing bumps the version of ``storages``."""

    def __init__(self, tensors: Callable[[], Sequence[torch.Tensor]], storages: Callable[[], Sequence[torch.Tensor]]):
        self._tensors, self._storages = tensors, storages
        self._expected: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._versions: list[int] = []

    def snapshot(self) -> None:
        """Record the current state as the engine's own (call after every engine write to the gradients)."""
        self._expected = [(t, t.grad) for t in self._tensors()]
        self._versions = [s._version for s in self._storages()]

    def detached(self) -> bool:
        return any(t.grad is not g for t, g in self._expected)

    def written(self) -> bool:
        """Whether user code wrote into the gradient storages since the last snapshot."""
        return [s._version for s in self._storages()] != self._versions

    def reattach(self) -> None:
        for t, g in self._expected:
            t.grad = g
