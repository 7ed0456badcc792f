"""The seqlen curriculum on the demo GPT: held-out loss at full context against tokens seen, with and without the
curriculum at the same token budget, and the throughput of the curriculum's early short-sequence steps.

Two runs of one engine each (world of one, CPU, the demo GPT on the Python stdlib's source as bytes), same seed,
same sample order, same optimizer and learning rate:
- baseline: every step 16 windows of the full context (``--context``, default 128 tokens);
- curriculum: ``curriculum_learning`` with ``truncate: true`` (the engine cuts each batch), fixed_linear from
  ``--min-seqlen`` to the full context over ``--curriculum-steps`` steps (difficulty_step 8); it runs until it has
  seen the baseline's token budget, so it takes more (shorter) steps.
Every ``--eval-every`` tokens both evaluate the mean loss on held-out windows (the tail of the corpus) at the full
context (evaluation is never cut). Throughput: optimizer steps at ``--min-seqlen`` and at the full context,
alternated in ``--repeats`` rounds; tokens/s per round, the median and interquartile range, and the per-round ratio.

Writes ``curriculum.png`` (matplotlib's object API on the Agg canvas, no pyplot) and ``curriculum.json`` under
``--out``; prints the figures. ``make bench-curriculum`` (ARGS=...) runs it; a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats import interquartile_range, median, per_round_ratios

import shardspeed
from shardspeed.demo.corpus import byte_tokens, read_corpus, train_eval_split
from shardspeed.demo.model import GPT, GPTConfig

BATCH = 16


def _config(args: argparse.Namespace, curriculum: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "steps_per_print": 10**9,
    }
    if curriculum:
        config["curriculum_learning"] = {
            "enabled": True,
            "curriculum_type": "seqlen",
            "truncate": True,
            "min_difficulty": args.min_seqlen,
            "max_difficulty": args.context,
            "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": args.curriculum_steps, "difficulty_step": 8},
        }
    return config


def _engine(args: argparse.Namespace, curriculum: bool) -> Any:
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(context_length=args.context, n_layer=args.layers, d_model=args.d_model, n_head=2))
    engine, *_ = shardspeed.initialize(model=model, config=_config(args, curriculum))
    return engine


def _held_out_loss(engine: Any, held_out: tuple[torch.Tensor, torch.Tensor]) -> float:
    engine.eval()
    with torch.no_grad():
        loss = float(engine(*held_out))
    engine.train()
    return loss


def _train_run(args: argparse.Namespace, curriculum: bool, train: Any, held_out: Any, order: torch.Tensor) -> dict:
    """Train until ``budget`` tokens; (tokens seen, held-out loss) every ``eval_every`` tokens."""
    engine = _engine(args, curriculum)
    budget = args.budget_steps * BATCH * args.context
    tokens, cursor, next_eval = 0, 0, 0
    curve: list[tuple[int, float]] = []
    lengths: list[int] = []
    start = time.perf_counter()
    while tokens < budget:
        if tokens >= next_eval:
            curve.append((tokens, _held_out_loss(engine, held_out)))
            next_eval += args.eval_every
        rows = [train[int(i)] for i in order[cursor : cursor + BATCH]]
        cursor = (cursor + BATCH) % (len(order) - BATCH)
        x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        seqlen = engine.curriculum_scheduler_legacy.get_current_difficulty() if curriculum else args.context
        lengths.append(seqlen)
        tokens += BATCH * seqlen
    curve.append((tokens, _held_out_loss(engine, held_out)))
    return {"curve": curve, "steps": len(lengths), "lengths": lengths, "seconds": time.perf_counter() - start}


def _throughput(args: argparse.Namespace, train: Any) -> dict:
    """Tokens/s of optimizer steps at the shortest and at the full length, alternated per round."""
    engine = _engine(args, curriculum=False)
    rows = [train[i] for i in range(BATCH)]
    x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    def timed(seqlen: int) -> float:
        xs, ys = x[:, :seqlen], y[:, :seqlen]
        for _ in range(2):  # warm-up at this shape
            engine.backward(engine(xs, ys))
            engine.step()
        began = time.perf_counter()
        for _ in range(args.timed_steps):
            engine.backward(engine(xs, ys))
            engine.step()
        return args.timed_steps * BATCH * seqlen / (time.perf_counter() - began)

    short, full = [], []
    for _ in range(args.repeats):
        short.append(timed(args.min_seqlen))
        full.append(timed(args.context))
    gain = per_round_ratios(short, full)
    return {
        "short_seqlen": args.min_seqlen,
        "short_tokens_per_s": short,
        "full_tokens_per_s": full,
        "gain_per_round": gain,
        "gain_median": median(gain),
        "gain_iqr": interquartile_range(gain),
    }


def _plot(results: dict, path: Path, args: argparse.Namespace) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, label in (("baseline", f"full context ({args.context})"), ("curriculum", "seqlen curriculum")):
        tokens, losses = zip(*results[name]["curve"], strict=True)
        ax.plot([t / 1e3 for t in tokens], losses, marker="o", markersize=3, label=label)
    ax.set_xlabel("training tokens seen (thousands)")
    ax.set_ylabel(f"held-out loss at full context ({args.context})")
    ax.set_title(
        f"demo GPT: seqlen curriculum {args.min_seqlen}→{args.context} over {args.curriculum_steps} steps "
        "vs full length"
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--min-seqlen", type=int, default=16)
    parser.add_argument("--curriculum-steps", type=int, default=100)
    parser.add_argument("--budget-steps", type=int, default=200, help="token budget = this many full-length steps")
    parser.add_argument("--eval-every", type=int, default=25_000, help="tokens between held-out evaluations")
    parser.add_argument("--eval-windows", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timed-steps", type=int, default=5)
    parser.add_argument("--corpus-bytes", type=int, default=4_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-curriculum"))
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    args.out.mkdir(parents=True, exist_ok=True)

    train, evaluation = train_eval_split(byte_tokens(read_corpus(args.corpus_bytes)), args.context)
    picks = torch.linspace(0, len(evaluation) - 1, args.eval_windows).long().tolist()
    held_out = tuple(torch.stack([evaluation[i][k] for i in picks]) for k in (0, 1))
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))
    results = {
        "baseline": _train_run(args, False, train, held_out, order),
        "curriculum": _train_run(args, True, train, held_out, order),
        "throughput": _throughput(args, train),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    _plot(results, args.out / "curriculum.png", args)
    (args.out / "curriculum.json").write_text(json.dumps(results, indent=1))

    base, cur, tp = results["baseline"], results["curriculum"], results["throughput"]
    print(f"token budget {args.budget_steps * BATCH * args.context} tokens; held-out loss at full context:")
    for name, run in (("baseline", base), ("curriculum", cur)):
        marks = ", ".join(f"{t / 1e3:.0f}k:{loss:.3f}" for t, loss in run["curve"])
        print(f"  {name:10s} {run['steps']} steps, {run['seconds']:.1f} s; {marks}")
    print(
        f"final held-out loss: baseline {base['curve'][-1][1]:.4f}, curriculum {cur['curve'][-1][1]:.4f} "
        f"(difference {cur['curve'][-1][1] - base['curve'][-1][1]:+.4f})"
    )
    lo, hi = tp["gain_iqr"]
    print(
        f"throughput: seqlen {tp['short_seqlen']} {median(tp['short_tokens_per_s']):.0f} tokens/s vs "
        f"{args.context} {median(tp['full_tokens_per_s']):.0f} tokens/s (medians of {args.repeats}); per-round ratio "
        f"short/full median {tp['gain_median']:.3f} (IQR {lo:.3f}-{hi:.3f}); a step at {tp['short_seqlen']} takes "
        f"{tp['short_seqlen'] / args.context / tp['gain_median']:.2f}x the time of a full-length step"
    )
    print(f"wrote {args.out / 'curriculum.png'} and {args.out / 'curriculum.json'}")
    return results


if __name__ == "__main__":
    main()
