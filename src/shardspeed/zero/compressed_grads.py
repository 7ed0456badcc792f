"""ZeRO stages 1/2 with 1-bit compression: each bucket's gradient reduce-scatter becomes error-fed 1-bit.

[Note: compressed ZeRO gradients] 1-bit Adam (stage 0) compresses the *momentum*: every rank keeps the full
momentum, and after the warm-up the momentum itself is all-reduced with error feedback. Under ZeRO-1/2 the momentum
is sharded: a rank holds 1/N of it, so there is nothing to all-reduce. What still crosses the wire every step is
the gradient reduce-scatter (and the parameter all-gather). So under ZeRO-1/2 the compressed phase compresses the
*gradient*: each bucket's reduce-scatter is the error-fed 1-bit ``CompressedReduceScatter`` (compression/, one per
bucket; the worker error buffer is the full bucket, so 4 bytes per model element on every rank). The sharded
optimizer then runs Adam without bias correction on its shard with the variance frozen at ``freeze_step``, as
1-bit Adam does. This is a different algorithm from 1-bit Adam (what is compressed, and where the error lives):
it has its own convergence evidence (benchmarks/bench_compression_convergence.py, ``zero2-onebitadam``).

Before ``freeze_step`` every bucket uses the stage's ordinary reduce-scatter (``communication_data_type``, pre/post
scaling); after it the compressor takes the bucket unscaled and returns the mean directly. The parameter
all-gather is never compressed (it carries weights, where an error would not be fed back anywhere).

[Note: raw-gradient compression] What is compressed is the raw local gradient (unscaled: divided by the fp16
loss scale first), with ``CompressedReduceScatter``'s DeepSpeed scale (the chunk's RMS), exactly as hC specified.
The shard then holds an approximate mean gradient in gradient units (times the loss scale again), so the engine's
norm, clipping and fp16 overflow check work on it unchanged, and stage 1's ``reopen`` (N × the reduced slice) stays
consistent across several backward passes. (An earlier version compressed g / (√v + ε) with a mean-|x| scale and
kept a full-size preconditioner: it clipped preconditioned units, double-preconditioned after ``reopen`` and cost
another 4Ψ plus an all-gather; it was removed.)

[Note: transactional error] An fp16 overflow (inf/NaN) in a local bucket would make the compressed chunk's scale
non-finite and the worker error inf − inf = NaN forever. So the compressor's worker error is snapshotted around
the launch (one bucket, transient; the compression itself runs synchronously inside ``launch``) and restored
where the new one is not finite (no host sync: a ``torch.where``). The non-finite scale still travels with the
signs, so every rank's reduced slice is non-finite, the engine's overflow check sees it on every rank and every
rank skips the step. The finite ranks' errors did take that step's compression; the gradient they sent is then
re-sent by error feedback later (one skipped step's contribution, in gradient units). The error is kept in
unscaled units (the loss scale divides the input and multiplies the output), so a change of the dynamic loss scale
does not re-weight the residual.

Memory per rank, Ψ elements, N ranks, Adam, mixed precision (ZeRO paper, K = 12): stage 1 4Ψ + 12Ψ/N, stage 2
2Ψ + 14Ψ/N (fp32 training: the parameters are the masters, stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N;
``zero_memory_bytes``). The compressed phase adds 4Ψ bytes per rank, whatever N: the worker error buffers (fp32, every
bucket at full size, each rank's slice padded to whole bytes of signs: ``error_buffer_bytes``; reported by
``engine.memory_breakdown()`` as ``compression_errors`` once built, at the first compressed step). At small N that
is most of what ZeRO-1/2 saves; the point of this path is bandwidth. Traffic
per step: the compressed reduce-scatter moves Ψ/8 · (N-1)/N bytes of signs plus one fp32 scale per rank and bucket,
the fp32 all-gather 4Ψ(N-1)/N: about half of plain fp32 ZeRO's 8Ψ(N-1)/N (per optimizer step with GAS = 1;
stage 2 reduce-scatters every micro-step, so with GAS > 1 both paths move GAS reduce-scatters and the ratio of the
reduce-scatter part is unchanged).

ZeRO-3 shards the parameters too and gathers them per unit inside forward and backward; its reduce-scatter runs
per unit on a schedule the optimizer does not see, and ZeroOneAdam's local steps or OneBitLamb's momentum-based
scaling coefficients need the full momentum. Those combinations are refused (``check_compression_combination``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from shardspeed.comm import Collectives, Work
from shardspeed.compression.collective import CompressedReduceScatter
from shardspeed.config.errors import ConfigError
from shardspeed.topology import AxisGroup
from shardspeed.zero.layout import ShardLayout

COMPRESSED_OPTIMIZERS: dict[str, str] = {
    "onebitadam": "OneBitAdam",
    "zerooneadam": "ZeroOneAdam",
    "onebitlamb": "OneBitLamb",
}
"""DeepSpeed's communication-compressed optimizer types (lower-case config name -> class name)."""


def compressed_optimizer_name(optimizer: object) -> str | None:
    """The DeepSpeed name of a 1-bit optimizer (an instance, a class, or a config type string), else None."""
    if isinstance(optimizer, str):
        name = optimizer
    else:
        cls = optimizer if isinstance(optimizer, type) else type(optimizer)
        name = str(getattr(cls, "deepspeed_name", cls.__name__))
    return COMPRESSED_OPTIMIZERS.get(name.lower().replace("_", ""))


def check_compression_combination(optimizer: object, stage: int) -> None:
    """One clear error for a 1-bit optimizer under a ZeRO stage it cannot run with (pure: every rank raises the
    same error from the same config before any collective). Stage 0 and OneBitAdam at stages 1/2 pass."""
    name = compressed_optimizer_name(optimizer)
    if name is None or stage == 0 or (stage in (1, 2) and name == "OneBitAdam"):
        return
    if stage == 3:
        why = (
            "ZeRO-3 gathers and reduce-scatters parameters per module inside forward and backward, outside the "
            "optimizer's control; use stage 0 (compressed momentum) or, for OneBitAdam, stage 1/2 (compressed "
            "gradient reduce-scatter)"
        )
    else:
        why = (
            "under ZeRO-1/2 the momentum is sharded, and "
            f"{name} needs the full momentum on every rank ("
            + ("its local steps and variance updates" if name == "ZeroOneAdam" else "its scaling coefficients")
            + "); use stage 0, or OneBitAdam at stage 1/2"
        )
    raise ConfigError(f"optimizer {name} with zero_optimization.stage {stage} is not supported: {why}")


def refuse_compression_combination(config: Any, optimizer: object) -> None:
    """``check_compression_combination`` for the optimizer ``initialize`` will build: the client's if given (as
    DeepSpeed, it wins over the config's section), else the config's type. The engine calls it first, before any
    collective (review C #9); ``build_engine_optimizer`` checks the built optimizer again (a client factory)."""
    cfg = getattr(config, "optimizer", None)
    chosen = optimizer if optimizer is not None else (cfg.type if cfg is not None else None)
    if chosen is not None:
        check_compression_combination(chosen, config.zero_optimization.stage)


class BucketCompressor(Protocol):
    """compression/collective.py's ``CompressedReduceScatter`` as this module uses it."""

    error_bytes: int
    worker_error: torch.Tensor

    def launch(self, shard: torch.Tensor, unsharded: torch.Tensor) -> Work: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None: ...

    def reset(self) -> None: ...


CompressorFactory = Callable[[int, AxisGroup, Collectives, torch.device], BucketCompressor]


def default_compressor(numel: int, axis: AxisGroup, collectives: Collectives, device: torch.device) -> BucketCompressor:
    return CompressedReduceScatter(numel, axis, collectives, device=device, tag="grads_1bit")


class GradCompression:
    """The compressed phase of a stage-1/2 gradient reduction: one error-fed compressor per bucket, built on first
    use (so a re-layout before the first reduction costs nothing). ``active`` asks the sharded optimizer (its
    step count against ``freeze_step``: the same on every rank, so every rank issues the same collectives).
    ``loss_scale`` gives the fp16 loss scale the gradients carry (the engine sets it; 1 otherwise)."""

    def __init__(
        self,
        axis: AxisGroup,
        collectives: Collectives,
        device: torch.device,
        factory: CompressorFactory = default_compressor,
    ) -> None:
        self.axis, self.collectives, self.device, self.factory = axis, collectives, device, factory
        # whether the compressed phase runs: asked at every launch (the optimizer's step count decides; a checkpoint
        # may load the states piecewise, so nothing is pushed on load)
        self.phase: Callable[[], bool] = lambda: False
        self.loss_scale: Callable[[], float] = lambda: 1.0
        self.layout: ShardLayout | None = None
        self._compressors: dict[int, BucketCompressor] = {}
        self._pending: dict[int, dict[str, torch.Tensor]] = {}  # loaded, for compressors not built yet
        self._scale_at_launch: dict[int, float] = {}

    @property
    def active(self) -> bool:
        return self.phase()

    def bind(self, layout: ShardLayout) -> None:
        """The stage's (new) layout. Compressors exist only in the compressed phase, long after the first
        backward's re-layout (zero/arrival_order.py), so a layout change drops none in practice; if it does, they
        restart at zero."""
        if self.layout is not None and self.layout.buckets != layout.buckets:
            self._compressors.clear()
        self.layout = layout

    def compressor(self, k: int) -> BucketCompressor:
        c = self._compressors.get(k)
        if c is None:
            assert self.layout is not None, "GradCompression used before bind(layout)"
            c = self.factory(self.layout.buckets[k].numel, self.axis, self.collectives, self.device)
            pending = self._pending.pop(k, None)
            if pending is not None:
                c.load_state_dict(pending)
            self._compressors[k] = c
        return c

    def launch(self, k: int, full_bucket: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Work]:
        """Compressed mean of bucket ``k``'s local gradient over the axis: (the fp32 input kept alive, this rank's
        fp32 output slice, the pending work). The input is divided by the loss scale (the error lives in gradient
        units); ``finish`` multiplies the output back. [Note: transactional error]: a non-finite bucket leaves
        the worker error as it was."""
        scale = float(self.loss_scale())
        self._scale_at_launch[k] = scale
        src = full_bucket.float() if scale == 1.0 else full_bucket.float() / scale
        if not src.is_contiguous():
            src = src.contiguous()
        out = torch.empty(src.numel() // self.axis.size, dtype=torch.float32, device=src.device)
        c = self.compressor(k)
        before = c.worker_error.clone()
        work = c.launch(out, src)  # the worker error is updated here, synchronously
        c.worker_error.copy_(torch.where(torch.isfinite(c.worker_error).all(), c.worker_error, before))
        return src, out, work

    def finish(self, k: int, out: torch.Tensor) -> None:
        """Bucket ``k``'s reduced slice back in the units of the stage's gradients (times the loss scale)."""
        scale = self._scale_at_launch.pop(k, 1.0)
        if scale != 1.0:
            out.mul_(scale)

    @property
    def error_bytes(self) -> int:
        """Bytes the worker error buffers hold on this rank (every bucket's compressor built so far)."""
        return sum(c.error_bytes for c in self._compressors.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Error buffers per bucket (``"bucket<k>.<name>"``), for the checkpoint; loaded ones not used yet are
        saved as loaded."""
        out = {f"bucket{k}.{n}": t for k, c in sorted(self._compressors.items()) for n, t in c.state_dict().items()}
        for k, part in sorted(self._pending.items()):
            out.update({f"bucket{k}.{n}": t for n, t in part.items()})
        return out

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """[Note: error buffers and the re-layout] A checkpoint is loaded into a fresh engine, whose layout is
        re-planned at its first backward (arrival order) into the same buckets the saving run had; the buffers
        are keyed by those buckets, so they are kept aside and handed to each bucket's compressor when it is
        built, in the compressed phase, after that re-layout."""
        self.reset()
        for key, t in sd.items():
            k, _, name = key.removeprefix("bucket").partition(".")
            self._pending.setdefault(int(k), {})[name] = t

    def reset(self) -> None:
        for c in self._compressors.values():
            c.reset()
        self._pending = {}


def error_buffer_bytes(layout: ShardLayout) -> int:
    """fp32 worker error bytes per rank: every bucket at full size, each rank's slice of it padded to whole bytes
    of signs (a multiple of 8 elements), as CompressedReduceScatter pads."""
    world = layout.world
    return sum(4 * world * (-(-(b.numel // world) // 8) * 8) for b in layout.buckets if world > 1)


def zero_memory_bytes(psi: int, world: int, stage: int, mixed: bool) -> int:
    """ZeRO's per-rank model-state bytes (Adam, K = 12): stage 1 2Ψ+2Ψ+12Ψ/N mixed (fp32: 4Ψ params+4Ψ grads
    ... see partitioned.py's table), stage 2 2Ψ + 14Ψ/N mixed. Without mixed precision the fp32 parameters are
    the masters: stage 1 4Ψ + 4Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N."""
    if mixed:
        return 4 * psi + 12 * psi // world if stage == 1 else 2 * psi + 14 * psi // world
    return 8 * psi + 8 * psi // world if stage == 1 else 4 * psi + 12 * psi // world
