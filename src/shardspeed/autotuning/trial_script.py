"""A training script for autotuning trials on the demo model (tests, ``benchmarks/bench_autotune.py``): the demo
GPT (shardspeed/demo/model.py) on random tokens, written as a DeepSpeed user writes one — ``--deepspeed_config``,
``initialize``, ``engine(x, y)`` / ``backward`` / ``step``. ``--checkpoint_activations`` recomputes each block in
backward (the autotuner's activation-checkpointing switch maps to it through ``arg_mappings``).

Launch: ``shardspeed --num_procs 2 src/shardspeed/autotuning/trial_script.py --deepspeed_config cfg.json``.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardspeed
from shardspeed.demo.model import GPT, GPTConfig


class Recomputed(nn.Module):
    """A block whose activations are recomputed in backward (only its input is saved)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False) if self.training else self.block(x)


def build_model(args: argparse.Namespace) -> GPT:
    model = GPT(GPTConfig(context_length=args.context, n_layer=args.layers, d_model=args.d_model, n_head=args.heads))
    if args.checkpoint_activations:
        model.blocks = nn.ModuleList(Recomputed(block) for block in model.blocks)
    return model


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps (a trial exits after its window)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--checkpoint_activations", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--micro_batch", type=int, help="checked against the config (an arg_mappings target)")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    torch.manual_seed(args.seed)
    model = build_model(args)
    parameters = model.parameters()
    engine, _, _, _ = shardspeed.initialize(model=model, model_parameters=parameters, config=args.deepspeed_config)
    generator = torch.Generator().manual_seed(args.seed + 1000 * engine.topology.dp_rank)
    batch = engine.train_micro_batch_size_per_gpu()
    if args.micro_batch is not None and args.micro_batch != batch:
        raise SystemExit(f"--micro_batch {args.micro_batch} but the config's micro-batch is {batch}")
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        tokens = torch.randint(0, 256, (batch, args.context + 1), generator=generator)
        x, y = tokens[:, :-1].to(engine.device), tokens[:, 1:].to(engine.device)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
