"""The HPO toy task: least squares whose good learning-rate range is a property of its data.

Each rank holds ``ROWS`` samples x = z·sqrt(λ) with z whitened per rank (zᵀz / ROWS = I exactly) and
y = x·w*, w* = 1; the model is ``Linear(D, 1, bias=False)`` from zero, trained by full-batch SGD on the mean
squared error. The loss's Hessian is 2·diag(λ) on every rank, λ = geomspace(0.05, 0.5, D), so:

* the loss is a function of w alone, the same on every rank (rank 0's reported loss is the global one) and for
  any world size, and the data-parallel mean gradient is the full-batch one;
* lr > 2 / h_max = 2 diverges (the stiffest mode grows by |1 - lr·h_max| > 1 per step);
* a small lr leaves the slowest mode (h_min = 0.1) untrained after ``steps``: its error shrinks only by
  (1 - lr·h_min) per step.

``good_range`` measures the resulting window by a dense single-process sweep (``simulate``: the same math in plain
torch) — e.g. 30 steps, judged by the mean of the last 3 losses ≤ 1e-3 × the initial loss: lr ∈ [0.60, 1.90].
Launched (``main``) it is a DeepSpeed-style script: ``--deepspeed_config``, ``initialize``, forward / backward /
step, ``--steps`` (a trial's engine stops it after the study's ``steps_per_trial``).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

D = 8
ROWS = 64
LAMBDAS = torch.logspace(math.log10(0.05), math.log10(0.5), D, dtype=torch.float64)
H_MAX = 2 * float(LAMBDAS.max())


def rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (x, y): whitened per rank, so its Hessian is exactly 2·diag(λ)."""
    generator = torch.Generator().manual_seed(1234 + rank)
    q, _ = torch.linalg.qr(torch.randn(ROWS, D, generator=generator, dtype=torch.float64))
    x = q * math.sqrt(ROWS) * LAMBDAS.sqrt()
    y = x @ torch.ones(D, 1, dtype=torch.float64)
    return x.float(), y.float()


def simulate(lr: float, steps: int) -> list[float]:
    """The losses a run at ``lr`` reports (each step's forward, before its update), in one process."""
    x, y = rank_data(0)
    w = torch.zeros(D, 1)
    losses = []
    for _ in range(steps):
        residual = x @ w - y
        losses.append(float(residual.square().mean()))
        w = w - lr * (2.0 / ROWS) * (x.T @ residual)  # the MSE's gradient, as autograd computes it
    return losses


def score(losses: list[float], window: int = 3) -> float:
    """The study's objective on these losses: the mean of the last ``window``."""
    return sum(losses[-window:]) / len(losses[-window:])


def good_range(steps: int, factor: float = 1e-3, points: int = 400) -> tuple[float, float]:
    """[lo, hi]: the lrs (log grid over [1e-3, 10]) whose score is ≤ ``factor`` x the initial loss."""
    initial = simulate(0.0, 1)[0]
    good = []
    for i in range(points):
        lr = 10 ** (-3 + 4 * i / (points - 1))
        value = score(simulate(lr, steps))
        if math.isfinite(value) and value <= factor * initial:
            good.append(lr)
    if not good:
        raise RuntimeError(f"no lr trains the toy task to {factor:g} x its initial loss in {steps} steps")
    return min(good), max(good)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the HPO toy task (least squares, SGD)")
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    import shardspeed

    model = torch.nn.Linear(D, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    engine, _, _, _ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=args.deepspeed_config
    )
    x, y = rank_data(engine.topology.dp_rank)
    for _ in range(args.steps):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
