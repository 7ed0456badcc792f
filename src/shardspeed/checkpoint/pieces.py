"""What a rank holds of each parameter, in checkpoint terms: pieces of flattened parameters.

Every ZeRO stage describes its model states as ``Piece``s — "elements [start, end) of parameter ``name``
live in this 1-D fp32 view, and the optimizer state for them is at ``opt_offset`` of ``opt_tensor``". Saving
writes the pieces a rank is responsible for; loading fills every piece a rank holds from whichever chunks of
the checkpoint overlap it. That one description is what makes checkpoints independent of stage and world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Piece:
    name: str  # canonical parameter name (tied parameters: the first name)
    full_shape: tuple[int, ...]
    start: int  # range of the flattened parameter
    end: int
    value: torch.Tensor  # 1-D view holding the fp32 (master) values of the range; loading writes into it
    opt_tensor: torch.Tensor | None  # the optimizer's tensor containing this range (None: frozen)
    opt_offset: int  # where the range starts inside opt_tensor (flattened)
    write: bool  # whether this rank writes it (replicated pieces are written by one rank only)

    @property
    def numel(self) -> int:
        return self.end - self.start
