"""One rank of bench_compression_convergence.py (run by torchrun): trains the demo GPT with one 1-bit optimizer
variant, compression on and off, for every seed, in this one set of processes; rank 0 writes the loss curves.

[Note: compression off] The baseline of each row is the same optimizer with compression off:
  - OneBitAdam / OneBitLamb (stage 0) and the ZeRO-2 OneBitAdam: ``freeze_step`` ≥ steps, so the whole run is
    the warm-up (exact all-reduced gradients; the issue's definition).
  - ZeroOneAdam: it compresses from the first step (its gradient all-reduce on variance-update steps and its
    momentum sync are both 1-bit; DeepSpeed has no uncompressed phase), so "off" is ``var_freeze_step`` ≥ steps,
    ``local_step_clipper`` 1 (no local steps: a sync every step) and every compressor replaced by an exact fp32
    mean all-reduce (``ExactMean``) — the same update rule with exact communication.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.distributed as dist

import shardspeed
from shardspeed.demo.corpus import ByteWindows, byte_tokens, read_corpus
from shardspeed.demo.model import GPT, GPTConfig

VARIANTS: dict[str, dict[str, Any]] = {
    "onebitadam": {"type": "OneBitAdam", "stage": 0, "freeze": "freeze_step", "lr": 1e-3},
    "zerooneadam": {"type": "ZeroOneAdam", "stage": 0, "freeze": "var_freeze_step", "lr": 1e-3},
    "onebitlamb": {"type": "OneBitLamb", "stage": 0, "freeze": "freeze_step", "lr": 2e-3},
    "zero2-onebitadam": {"type": "OneBitAdam", "stage": 2, "freeze": "freeze_step", "lr": 1e-3},
}


class ExactMean:
    """A compressor's interface with an exact fp32 mean all-reduce ([Note: compression off])."""

    error_bytes = 0

    def __init__(self, numel: int, axis: Any, collectives: Any) -> None:
        self.axis, self.collectives = axis, collectives

    def __call__(self, tensor: torch.Tensor) -> None:
        self.collectives.all_reduce(tensor, self.axis, tag="exact_mean")
        tensor.div_(self.axis.size)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        pass

    def reset(self) -> None:
        pass


def available(variant: str) -> bool:
    """Whether this checkout registers the variant's optimizer type (B2's may land later than B's)."""
    from shardspeed.config.errors import ConfigError
    from shardspeed.optim.names import canonical_optimizer_name

    try:
        canonical_optimizer_name(VARIANTS[variant]["type"])
    except ConfigError:
        return variant == "zero2-onebitadam"  # runs on its own class (zero/compressed_adam.py) without B's
    return True


def _config(
    variant: str,
    compressed: bool,
    steps: int,
    freeze: int,
    micro: int,
    bucket: int,
    lr: float | None = None,
    schedule: str = "warmup",
) -> dict[str, Any]:
    spec = {**VARIANTS[variant], **({"lr": lr} if lr else {})}
    # β2 0.95 (the demo's): 1/(1-β2) = 20 steps ≤ freeze_step, so the variance has settled when it freezes. With
    # DeepSpeed's default 0.999 it is ~5% grown at step 45 and, without bias correction, frozen 4-5x too small:
    # the frozen run then diverges even with no compression at all (seen at world 1).
    params: dict[str, Any] = {"lr": spec["lr"], spec["freeze"]: freeze if compressed else 10 * steps + 10}
    if variant != "onebitlamb":
        params["betas"] = [0.9, 0.95]
    if variant == "zerooneadam" and not compressed:
        params["local_step_clipper"] = 1
    return {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": spec["type"], "params": params},
        "scheduler": _schedule(schedule, spec["lr"], steps),
        "zero_optimization": {"stage": spec["stage"], "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
        "steps_per_print": 10**9,
    }


def _schedule(kind: str, lr: float, steps: int) -> dict[str, Any]:
    """``warmup``: DeepSpeed's WarmupLR (10% warm-up, then hold); ``decay``: WarmupDecayLR (then linear to 0 at the
    last step, as BERT/GPT pre-training schedules do)."""
    params: dict[str, Any] = {"warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": max(1, steps // 10)}
    if kind == "decay":
        return {"type": "WarmupDecayLR", "params": {**params, "total_num_steps": steps}}
    return {"type": "WarmupLR", "params": params}


def _engine(variant: str, model: GPT, config: dict[str, Any], compressed: bool) -> Any:
    from shardspeed.config.errors import ConfigError
    from shardspeed.optim.names import canonical_optimizer_name

    spec, opt = VARIANTS[variant], None
    try:
        canonical_optimizer_name(spec["type"])
    except ConfigError:  # the ZeRO-2 variant without B's registration: its own class, as a client optimizer
        from shardspeed.zero.compressed_adam import ZeroOneBitAdam

        params = dict(config.pop("optimizer")["params"])
        opt = ZeroOneBitAdam(model.parameters(), **params)
    if variant == "zerooneadam" and not compressed:
        from shardspeed.optim.compressed_types import COMPRESSED_TYPES

        base = COMPRESSED_TYPES["ZeroOneAdam"].cls()

        class ExactZeroOneAdam(base):  # type: ignore[misc, valid-type]
            def compressor(self, key: str, numel: int) -> Any:
                return ExactMean(numel, self.axis, self._collectives)

        opt = ExactZeroOneAdam(model.parameters(), **config.pop("optimizer")["params"])
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=opt, config=config)
    return engine


def train(args: argparse.Namespace, seed: int, compressed: bool, windows: ByteWindows) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = args.global_batch // world
    torch.manual_seed(seed)
    model = GPT(GPTConfig(context_length=args.seq, n_layer=args.layers, d_model=args.dim, n_head=2))
    freeze = max(1, round(args.freeze_frac * args.steps))
    engine = _engine(
        args.variant,
        model,
        _config(args.variant, compressed, args.steps, freeze, micro, args.bucket, args.lr, args.schedule),
        compressed,
    )
    g = torch.Generator().manual_seed(1000 + seed)  # the same global batches for on and off, any world size
    losses = []
    for _ in range(args.steps):
        idx = torch.randint(len(windows), (args.global_batch,), generator=g)[rank * micro : (rank + 1) * micro]
        x = torch.stack([windows[int(i)][0] for i in idx])
        y = torch.stack([windows[int(i)][1] for i in idx])
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    engine.destroy()
    return losses


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", required=True, choices=sorted(VARIANTS))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--freeze-frac", type=float, default=0.15)
    p.add_argument("--bucket", type=int, default=500_000_000)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the variant's)")
    p.add_argument("--schedule", choices=("warmup", "decay"), default="warmup")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    shardspeed.init_distributed()
    windows = ByteWindows(byte_tokens(read_corpus(2_000_000)), args.seq)
    runs = []
    for seed in range(args.seeds):
        for compressed in (True, False):
            runs.append({"seed": seed, "compressed": compressed, "losses": train(args, seed, compressed, windows)})
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"variant": args.variant, "world": dist.get_world_size(), "runs": runs}, f)


if __name__ == "__main__":
    main()
