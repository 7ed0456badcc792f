"""Cross-entropy over vocabulary-split logits (Megatron-LM's ``vocab_parallel_cross_entropy``), without gathering
the logits.

Each tensor rank holds logits ``[..., c]`` for its slice of the vocabulary (``c = ceil(V/TP)``, padding columns
past ``V`` included). The loss ``log Σ_v exp(z_v) − z_target`` needs three sums over the whole vocabulary, each an
all-reduce of one number per token (``b·s`` elements): the max (for a stable exp), the target's logit (held by one
rank, zero on the others) and the sum of exps. The gradient is local: ``softmax − one_hot(target)`` on this
rank's slice, so backward communicates nothing. Padding columns are set to −inf before everything (they get
probability 0 and gradient 0). The arithmetic runs in fp32; the gradient is returned in the logits' dtype.

Comms-log tags: ``tp.ce.max``, ``tp.ce.target``, ``tp.ce.sum_exp``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from shardspeed.tensor_parallel.context import TensorParallel
from shardspeed.tensor_parallel.embedding import vocab_range

Reduction = Literal["mean", "sum", "none"]


def local_vocab_slice(width: int, vocab_size: int | None, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``(start, real_width)``: the global id of this rank's first logit column and how many of its ``width``
    columns are real (the rest are padding). Pure. ``vocab_size=None``: every rank holds ``width`` real columns
    (the vocabulary is ``width · tp_size``)."""
    if vocab_size is None:
        return tp_rank * width, width
    start, real_end, padded_end = vocab_range(vocab_size, tp_rank, tp_size)
    if width != padded_end - start:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits hold {width} vocabulary columns on tensor rank {tp_rank}, but a "
            f"vocabulary of {vocab_size} over {tp_size} ranks gives {padded_end - start} per rank (padded)"
        )
    return start, real_end - start


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        tp: TensorParallel,
        vocab_size: int | None,
        ignore_index: int,
    ) -> torch.Tensor:
        width = logits.shape[-1]
        start, real = local_vocab_slice(width, vocab_size, tp.rank, tp.size)
        z = logits.float()  # a copy for low precision; cloned below for fp32, so the caller's logits stay intact
        z = z.clone() if z is logits else z
        if real < width:
            z[..., real:] = float("-inf")  # padding columns: probability 0, gradient 0

        row_max = z.max(dim=-1).values
        tp.collectives.all_reduce_max(row_max, tp.axis, tag="tp.ce.max")
        z.sub_(row_max.unsqueeze(-1))

        ignored = target == ignore_index
        local_target = target - start
        outside = (local_target < 0) | (local_target >= real) | ignored
        local_target = local_target.masked_fill(outside, 0)
        target_logit = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        tp.collectives.all_reduce(target_logit, tp.axis, tag="tp.ce.target")

        z.exp_()  # z now holds exp(z - max)
        sum_exp = z.sum(dim=-1)
        tp.collectives.all_reduce(sum_exp, tp.axis, tag="tp.ce.sum_exp")

        loss = (torch.log(sum_exp) - target_logit).masked_fill(ignored, 0.0)
        z.div_(sum_exp.unsqueeze(-1))  # softmax over the whole vocabulary, this rank's columns
        ctx.save_for_backward(z, local_target, outside, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        softmax, local_target, outside, ignored = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype)  # 1 where this rank holds the target column
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def _check_targets(target: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    # Targets are identical on every tensor rank, so this error is alike on all of them. Without the check a
    # target past the vocabulary would silently count as "held by no rank" (loss = log-sum-exp).
    valid = target[target != ignore_index]
    if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab_size):
        raise IndexError(
            f"vocab_parallel_cross_entropy: targets must lie in [0, {vocab_size}) or equal ignore_index "
            f"{ignore_index}; got min {int(valid.min())}, max {int(valid.max())}"
        )


def vocab_parallel_cross_entropy(
    logits_parallel: torch.Tensor,
    target: torch.Tensor,
    tp: TensorParallel,
    *,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(gathered_logits.flatten(0, -2), target.flatten(), ignore_index=, reduction=)`` computed on
    vocabulary-split logits ``[..., c]`` (``target`` ``[...]``, identical on every tensor rank).

    ``vocab_size``: the real vocabulary ``V`` when the logits come from a padded table (a tied
    ``VocabParallelEmbedding`` head): columns past ``V`` are excluded. ``reduction="mean"`` averages over the
    targets that are not ``ignore_index`` (NaN if all are, as torch); ``"none"`` returns per-token losses shaped
    like ``target`` (0 at ignored positions). On a tensor axis of one rank this is plain cross-entropy.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if tuple(logits_parallel.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits of shape {tuple(logits_parallel.shape)} do not match targets of "
            f"shape {tuple(target.shape)} (expected logits [..., vocab slice] and targets [...])"
        )
    if target.is_floating_point():
        raise TypeError("vocab_parallel_cross_entropy: targets must be integer class ids")
    _check_targets(target, vocab_size or logits_parallel.shape[-1] * tp.size, ignore_index)
    losses = _VocabParallelCrossEntropy.apply(logits_parallel, target, tp, vocab_size, ignore_index)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (target != ignore_index).sum()
