"""The parameter-spec registry: what each parameter is a piece of, for every consumer that must see the whole model.

[Note: parameter specs] Under tensor parallelism a rank's ``nn.Parameter`` is a slice of a *global* tensor (the one a
single-process model would hold). Everything that reasons about the whole model — the gradient norm, the fp16
overflow verdict, Lamb's trust ratios, checkpoints — must know, per parameter:
- its global shape, and along which dim (if any) it is split over the tensor axis (``partition_dim``);
- for fused tensors (a QKV projection holding q, k and v blocks along the partition dim), how many equal blocks
  are each split separately (``parts``, Megatron's partition stride): rank r holds block-slice r of q, of k, of v;
- whether it is replicated over the tensor axis (every tensor rank holds the same full tensor) and, if so, whether
  its gradient is *partial* there (``partial_grad``: a layer norm inside a sequence-parallel region sees only this
  rank's sequence shard, so the tensor ranks' gradients must be summed).
Parameters are never given attributes ([STYLE]); the module that owns a parameter declares its spec
(``SpecProvider.tensor_parallel_specs()``, keyed by the parameter's attribute name), and ``ParamSpecs.collect``
gathers them once per engine, keyed by the parameter's canonical (first) name. A parameter no module declares is
replicated over the tensor axis with its own shape as the global shape — which is exactly the world before tensor
parallelism, so DP-only models need nothing.

Slicing rule (``shard_bounds``): a dim of size ``d`` split ``n`` ways gives rank ``r`` the range
``[r·c, min((r+1)·c, d))`` with ``c = ceil(d / n)``, so every rank but the last holds exactly ``ceil(d/n)``
(the last may hold less, or nothing). Layers whose ranks must hold equal slices (the vocabulary) say so with
``padded``: the global shape stays the real one (what a dense model holds, so checkpoints and consolidation see
no padding), every rank holds ``padded / n`` entries along the split dim, and those past ``d`` are zero padding
that lies outside every box (never saved, never loaded, never counted).

Everything here is pure: no process group, no rank lookup; callers pass the tensor rank and size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn


def shard_bounds(dim: int, size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of ``rank``'s slice when a dim of length ``dim`` is split ``size`` ways (ceil chunks)."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"shard_bounds: rank {rank} outside a split of {size}")
    chunk = math.ceil(dim / size) if dim else 0
    start = min(rank * chunk, dim)
    return start, min(start + chunk, dim)


@dataclass(frozen=True)
class Segment:
    """A run along the partition dim: local indices ``[local_start, local_start+length)`` hold global indices
    ``[global_start, global_start+length)``."""

    local_start: int
    global_start: int
    length: int


@dataclass(frozen=True)
class Box:
    """An axis-aligned block of a global tensor held locally: ``shape`` elements starting at ``global_offset`` in
    the global tensor, and at ``local_offset`` in the local parameter. A plain (unsplit) parameter is one box
    covering everything; a fused split parameter is ``parts`` boxes."""

    local_offset: tuple[int, ...]
    global_offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParamSpec:
    """What one parameter is a piece of ([Note: parameter specs])."""

    global_shape: tuple[int, ...]
    partition_dim: int | None = None
    """Dim split over the tensor axis; None: every tensor rank holds the whole tensor (replicated)."""
    parts: int = 1
    """Equal blocks along ``partition_dim`` split separately (fused QKV: 3); 1 for ordinary tensors."""
    partial_grad: bool = False
    """Replicated, but each tensor rank computes a partial gradient (sequence-parallel layer norms, row-parallel
    biases under sequence parallelism): the gradient is summed over the tensor axis."""
    padded: int | None = None
    """The partition dim padded to this length (a multiple of the split size) before splitting, so every rank
    holds ``padded / tp_size`` entries; local entries past the global dim are padding outside every box
    (``VocabParallelEmbedding``). None: no padding (ceil chunks, the last rank may hold less)."""

    def __post_init__(self) -> None:
        if self.padded is not None:
            if self.partition_dim is None or self.parts != 1:
                raise ValueError("padded applies to split, unfused parameters only (partition_dim set, parts=1)")
            if self.padded < self.global_shape[self.partition_dim]:
                raise ValueError(f"padded={self.padded} is shorter than dim {self.partition_dim} ({self.global_shape})")
        if self.partition_dim is not None:
            if not 0 <= self.partition_dim < len(self.global_shape):
                raise ValueError(f"partition_dim {self.partition_dim} outside a {len(self.global_shape)}-d tensor")
            if self.parts < 1 or self.global_shape[self.partition_dim] % self.parts:
                raise ValueError(
                    f"a fused tensor of {self.global_shape[self.partition_dim]} along dim {self.partition_dim} "
                    f"cannot hold {self.parts} equal parts"
                )
            if self.partial_grad:
                raise ValueError("partial_grad applies to replicated parameters only (partition_dim=None)")

    @property
    def partitioned(self) -> bool:
        return self.partition_dim is not None

    def segments(self, tp_rank: int, tp_size: int) -> list[Segment]:
        """The runs along the partition dim this rank holds, in local order (one per fused part)."""
        if self.partition_dim is None:
            return []
        if self.padded is not None:
            chunk = self._padded_chunk(tp_size)
            dim = self.global_shape[self.partition_dim]
            start = min(tp_rank * chunk, dim)
            return [Segment(0, start, min(dim, tp_rank * chunk + chunk) - start)]
        block = self.global_shape[self.partition_dim] // self.parts
        start, end = shard_bounds(block, tp_size, tp_rank)
        out, local = [], 0
        for part in range(self.parts):
            out.append(Segment(local, part * block + start, end - start))
            local += end - start
        return out

    def _padded_chunk(self, tp_size: int) -> int:
        assert self.padded is not None
        if self.padded % tp_size:
            raise ValueError(f"a dim padded to {self.padded} cannot be split evenly {tp_size} ways")
        return self.padded // tp_size

    def local_shape(self, tp_rank: int, tp_size: int) -> tuple[int, ...]:
        if self.partition_dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        if self.padded is not None:
            shape[self.partition_dim] = self._padded_chunk(tp_size)  # padding included: equal on every rank
        else:
            shape[self.partition_dim] = sum(s.length for s in self.segments(tp_rank, tp_size))
        return tuple(shape)

    def boxes(self, tp_rank: int, tp_size: int) -> list[Box]:
        """The boxes of the global tensor this rank's parameter holds (empty boxes left out)."""
        zeros = (0,) * len(self.global_shape)
        if self.partition_dim is None:
            return [Box(zeros, zeros, self.global_shape)]
        d, out = self.partition_dim, []
        for seg in self.segments(tp_rank, tp_size):
            if seg.length == 0:
                continue
            shape = list(self.global_shape)
            shape[d] = seg.length
            local, glob = list(zeros), list(zeros)
            local[d], glob[d] = seg.local_start, seg.global_start
            out.append(Box(tuple(local), tuple(glob), tuple(shape)))
        return out

    def counted_in_norm(self, tp_rank: int) -> bool:
        """Whether this rank's copy counts in a sum over the model (the gradient norm): split parameters on every
        tensor rank (each holds different elements), replicated ones on tensor rank 0 only."""
        return self.partitioned or tp_rank == 0

    def slice_global(self, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        """This rank's local tensor cut from the ``full`` global one (AutoTP slicing, checkpoint tests)."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"slice_global: tensor of shape {tuple(full.shape)}, spec says {self.global_shape}")
        if self.partition_dim is None:
            return full
        pieces = [full.narrow(self.partition_dim, s.global_start, s.length) for s in self.segments(tp_rank, tp_size)]
        if self.padded is not None:  # zero rows up to the padded local length
            local = self.local_shape(tp_rank, tp_size)
            out = full.new_zeros(local)
            out.narrow(self.partition_dim, 0, pieces[0].shape[self.partition_dim]).copy_(pieces[0])
            return out
        return torch.cat(pieces, dim=self.partition_dim) if len(pieces) > 1 else pieces[0]


@runtime_checkable
class SpecProvider(Protocol):
    """A module that owns tensor-parallel parameters declares their specs, keyed by the parameter's path below it
    (``"weight"``, ``"bias"``, or ``"norm.weight"`` for a wrapper); parameters it leaves out are replicated."""

    def tensor_parallel_specs(self) -> dict[str, ParamSpec]: ...


@runtime_checkable
class TiedCopyProvider(Protocol):
    """A pipeline module whose stages hold copies of one weight (``TiedLayerSpec``): the names, on this rank, of
    the parameters that are a copy of a weight another pipeline stage *owns*. A copy is left out of the gradient
    norm (the owner counts it) and out of checkpoints (the owner writes it) ([Note: tied copies])."""

    def tied_copy_names(self) -> frozenset[str]: ...


class ParamSpecs:
    """The registry of one engine: spec per canonical parameter name (and by identity), for this tensor rank.

    [Note: tied copies] Under pipeline parallelism a weight tied across stages (an embedding and the LM head) is
    one model parameter held by several stages; its gradients are summed over those stages, so every copy holds
    the same gradient and, after the step, the same value. Sums over the model (the norm) and checkpoints must see
    it once: the lowest stage holding it owns it, the others' names are ``tied_copies``."""

    def __init__(
        self,
        by_name: dict[str, ParamSpec],
        by_id: dict[int, tuple[torch.Tensor, ParamSpec]],
        tp_rank: int,
        tp_size: int,
        tied_copies: frozenset[str] = frozenset(),
    ) -> None:
        self._by_name = by_name
        # Keyed by id, holding the parameter itself: ZeRO-3's zero.Init replaces meta parameters by new objects,
        # and a bare id of a dead parameter could be recycled by an unrelated one (meta tensors cost no memory).
        self._by_id = by_id
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tied_copies = tied_copies
        """Names of this rank's parameters that copy a weight another pipeline stage owns ([Note: tied copies])."""

    @classmethod
    def collect(cls, module: nn.Module, tp_rank: int = 0, tp_size: int = 1) -> ParamSpecs:
        """Specs declared by ``module``'s submodules (``SpecProvider``), checked against the local shapes."""
        by_name: dict[str, ParamSpec] = {}
        by_id: dict[int, tuple[torch.Tensor, ParamSpec]] = {}
        canonical: dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            canonical.setdefault(id(p), name)
        for prefix, sub in module.named_modules():
            if not isinstance(sub, SpecProvider):
                continue
            for attr, spec in sub.tensor_parallel_specs().items():
                p = sub.get_parameter(attr)  # dotted paths allowed: a wrapper may declare its inner norm's weight
                full_name = f"{prefix}.{attr}" if prefix else attr
                if not isinstance(p, nn.Parameter):
                    raise TypeError(f"{type(sub).__name__} declares a spec for '{full_name}', which is not a parameter")
                expected = spec.local_shape(tp_rank, tp_size)
                if not p.is_meta and tuple(p.shape) != expected and p.numel() > 0:
                    raise ValueError(
                        f"parameter '{full_name}' has local shape {tuple(p.shape)} but its spec (global "
                        f"{spec.global_shape}, split on dim {spec.partition_dim}) gives {expected} on tensor rank "
                        f"{tp_rank} of {tp_size}"
                    )
                previous = by_id.get(id(p))
                if previous is not None and previous[1] != spec:
                    raise ValueError(f"parameter '{full_name}' is declared twice with different specs")
                by_id[id(p)] = (p, spec)
                by_name[canonical.get(id(p), full_name)] = spec
        tied = module.tied_copy_names() if isinstance(module, TiedCopyProvider) else frozenset()
        return cls(by_name, by_id, tp_rank, tp_size, frozenset(tied))

    def of(self, param: torch.Tensor, name: str | None = None) -> ParamSpec:
        """The spec of ``param`` (identity first, then canonical name); undeclared: replicated, its own shape."""
        entry = self._by_id.get(id(param))
        spec = entry[1] if entry is not None and entry[0] is param else None
        if spec is None and name is not None:
            spec = self._by_name.get(name)
        return spec if spec is not None else ParamSpec(tuple(param.shape))

    def by_name(self, name: str) -> ParamSpec | None:
        return self._by_name.get(name)

    def counted_in_norm(self, param: torch.Tensor, name: str | None = None) -> bool:
        return self.of(param, name).counted_in_norm(self.tp_rank)

    def partitioned_names(self) -> Iterator[str]:
        return (n for n, s in self._by_name.items() if s.partitioned)

    @property
    def any_partitioned(self) -> bool:
        return any(s.partitioned for s in self._by_name.values())
