"""Vocabulary partition math, the padded parameter spec, cross-entropy on a tensor axis of one, and the dropout
streams' seeding — all without processes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardspeed.checkpointing import CheckpointingContext, RNGStatesTracker
from shardspeed.params.assemble import place_box
from shardspeed.params.spec import ParamSpec, ParamSpecs
from shardspeed.tensor_parallel import TensorParallel
from shardspeed.tensor_parallel.cross_entropy import local_vocab_slice, vocab_parallel_cross_entropy
from shardspeed.tensor_parallel.embedding import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    padded_vocab_size,
    vocab_range,
)
from shardspeed.tensor_parallel.random import TensorParallelDropout, model_parallel_seed, tensor_parallel_dropout
from shardspeed.topology import AxisGroup

CPU = torch.device("cpu")


def tp_of(rank: int = 0, size: int = 1) -> TensorParallel:
    """A tensor axis for pure math (no process group: only rank/size are read)."""
    return TensorParallel(AxisGroup("tensor", None, tuple(range(size)), rank))


# ------------------------------------------------------------------------------------------------ partition math
@pytest.mark.parametrize(
    ("vocab", "size", "expected"),
    [
        (37, 2, [(0, 19, 19), (19, 37, 38)]),
        (37, 4, [(0, 10, 10), (10, 20, 20), (20, 30, 30), (30, 37, 40)]),
        (5, 4, [(0, 2, 2), (2, 4, 4), (4, 5, 6), (6, 6, 8)]),  # the last rank holds only padding
        (8, 4, [(0, 2, 2), (2, 4, 4), (4, 6, 6), (6, 8, 8)]),
    ],
)
def test_vocab_range_gives_every_rank_ceil_rows_and_covers_the_vocabulary_once(vocab, size, expected) -> None:
    got = [vocab_range(vocab, r, size) for r in range(size)]
    assert got == expected
    assert padded_vocab_size(vocab, size) == expected[-1][2]
    assert all(end - start == -(-vocab // size) for start, _, end in got)
    assert sum(real - start for start, real, _ in got) == vocab


def test_vocab_range_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        vocab_range(0, 0, 1)
    with pytest.raises(ValueError, match="tensor rank 2 outside a tensor axis of 2"):
        vocab_range(10, 2, 2)


@pytest.mark.parametrize(("vocab", "size"), [(37, 2), (37, 4), (5, 4), (8, 2)])
def test_padded_spec_keeps_the_real_global_shape_and_leaves_padding_outside_the_boxes(vocab, size) -> None:
    spec = ParamSpec((vocab, 3), partition_dim=0, padded=padded_vocab_size(vocab, size))
    full = torch.arange(vocab * 3, dtype=torch.float32).view(vocab, 3)
    rebuilt = torch.full_like(full, -1.0)
    covered = 0
    for rank in range(size):
        start, real_end, end = vocab_range(vocab, rank, size)
        assert spec.local_shape(rank, size) == (end - start, 3)  # equal on every rank
        local = spec.slice_global(full, rank, size)
        assert local.shape == (end - start, 3)
        assert torch.equal(local[real_end - start :], torch.zeros(end - real_end, 3))  # zero padding rows
        for box in spec.boxes(rank, size):
            assert box.local_offset == (0, 0) and box.global_offset == (start, 0)
            place_box(local, box, rebuilt)
            covered += box.numel
    assert covered == full.numel() and torch.equal(rebuilt, full)  # every real element in exactly one box


def test_padded_spec_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="padded applies to split, unfused parameters only"):
        ParamSpec((6, 2), partition_dim=0, parts=2, padded=8)
    with pytest.raises(ValueError, match="padded applies to split"):
        ParamSpec((6, 2), padded=8)
    with pytest.raises(ValueError, match="padded=4 is shorter than dim 0"):
        ParamSpec((6, 2), partition_dim=0, padded=4)
    with pytest.raises(ValueError, match="padded to 7 cannot be split evenly 2 ways"):
        ParamSpec((6, 2), partition_dim=0, padded=7).local_shape(0, 2)


def test_embedding_declares_the_real_vocabulary_and_holds_padded_rows() -> None:
    emb = VocabParallelEmbedding(37, 4, tp_of(1, 2))  # rank 1 of 2: rows 19..36 and one padding row
    assert tuple(emb.weight.shape) == (19, 4)
    assert emb.weight[18].abs().sum() == 0
    specs = ParamSpecs.collect(nn.ModuleDict({"wte": emb, "head": VocabParallelLMHead(emb)}), 1, 2)
    spec = specs.by_name("wte.weight")
    assert spec is not None and spec.global_shape == (37, 4) and spec.padded == 38
    assert specs.of(emb.weight) is spec  # the tied head's parameter is the same one, same spec


def test_embedding_equals_nn_embedding_on_one_rank_and_refuses_ids_outside_the_vocabulary() -> None:
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(11, 4, tp_of(), padding_idx=3)
    torch.manual_seed(0)
    dense = nn.Embedding(11, 4, padding_idx=3)
    tokens = torch.tensor([[0, 3, 10], [5, 5, 1]])
    assert torch.equal(emb(tokens), dense(tokens)) and torch.equal(emb.weight, dense.weight)
    with pytest.raises(IndexError, match=r"token ids must lie in \[0, 11\), got min 0, max 11"):
        emb(torch.tensor([0, 11]))
    with pytest.raises(ValueError, match=r"padding_idx 11 outside the vocabulary \[0, 11\)"):
        VocabParallelEmbedding(11, 4, tp_of(), padding_idx=11)


def test_embedding_padding_idx_is_local_to_the_rank_holding_it() -> None:
    assert VocabParallelEmbedding(10, 2, tp_of(0, 2), padding_idx=7).local_padding_idx is None
    rank1 = VocabParallelEmbedding(10, 2, tp_of(1, 2), padding_idx=7)
    assert rank1.local_padding_idx == 2 and rank1.weight[2].abs().sum() == 0


# ------------------------------------------------------------------------------------------------ cross-entropy
def test_local_vocab_slice() -> None:
    assert local_vocab_slice(19, 37, 1, 2) == (19, 18)
    assert local_vocab_slice(2, 5, 3, 4) == (6, 0)
    assert local_vocab_slice(8, None, 2, 4) == (16, 8)
    with pytest.raises(ValueError, match="logits hold 18 vocabulary columns on tensor rank 1, but a vocabulary of 37"):
        local_vocab_slice(18, 37, 1, 2)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_on_one_rank_equals_torch_with_ignored_rows(reduction: str) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (5 * torch.randn(4, 3, 9, generator=g)).requires_grad_()
    target = torch.randint(0, 9, (4, 3), generator=g)
    target[1, 2] = target[3, 0] = -1
    ours = vocab_parallel_cross_entropy(logits, target, tp_of(), ignore_index=-1, reduction=reduction)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.flatten(0, 1), target.flatten(), ignore_index=-1, reduction=reduction)
    ref = ref.view(4, 3) if reduction == "none" else ref
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    w = torch.randn(ours.shape, generator=g)
    (ours * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-6, atol=1e-6)


def test_cross_entropy_is_stable_for_huge_logits_and_keeps_the_input() -> None:
    logits = torch.tensor([[1e4, 0.0, -1e4], [3e4, 3e4, 0.0]], requires_grad=True)
    before = logits.detach().clone()
    target = torch.tensor([0, 1])
    loss = vocab_parallel_cross_entropy(logits, target, tp_of(), reduction="none")
    torch.testing.assert_close(loss, F.cross_entropy(before, target, reduction="none"))
    assert torch.isfinite(loss).all() and torch.equal(logits.detach(), before)


def test_cross_entropy_low_precision_logits_get_a_gradient_of_their_dtype() -> None:
    logits = torch.randn(5, 7).to(torch.bfloat16).requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, torch.arange(5), tp_of())
    assert loss.dtype == torch.float32
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16


def test_cross_entropy_errors_name_the_culprit() -> None:
    logits = torch.randn(2, 3, 5)
    with pytest.raises(IndexError, match=r"targets must lie in \[0, 5\) or equal ignore_index -100; got min 0, max 5"):
        vocab_parallel_cross_entropy(logits, torch.tensor([[0, 1, 5], [0, 0, 0]]), tp_of())
    with pytest.raises(ValueError, match=r"logits of shape \(2, 3, 5\) do not match targets of shape \(2,\)"):
        vocab_parallel_cross_entropy(logits, torch.tensor([0, 1]), tp_of())
    with pytest.raises(ValueError, match="reduction must be 'mean', 'sum' or 'none', got 'avg'"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 3, dtype=torch.long), tp_of(), reduction="avg")
    with pytest.raises(TypeError, match="targets must be integer class ids"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 3), tp_of())


# ------------------------------------------------------------------------------------------------ dropout streams
def test_model_parallel_seed_matches_the_checkpointing_contexts_streams() -> None:
    ours = RNGStatesTracker(CPU)
    model_parallel_seed(ours, tp_of(1, 2), 100)
    with ours.fork():
        a = torch.rand(6)
    default_a = torch.rand(6)
    ctx = CheckpointingContext(tensor_axis=AxisGroup("tensor", None, (0, 1), 1), tracker=RNGStatesTracker(CPU))
    ctx.model_parallel_manual_seed(100)
    with ctx.tracker.fork():
        b = torch.rand(6)
    assert torch.equal(a, b) and torch.equal(default_a, torch.rand(6))  # same two streams, by either route


def test_dropout_regions_pick_their_stream() -> None:
    tracker = RNGStatesTracker(CPU)
    model_parallel_seed(tracker, tp_of(0, 2), 7)
    state = tracker.get_states()
    x = torch.ones(64)
    split = TensorParallelDropout(0.5, tracker, "split")(x)
    replicated = tensor_parallel_dropout(x, 0.5, True, tracker, "replicated")
    torch.manual_seed(7)
    assert torch.equal(replicated, F.dropout(x, 0.5, training=True))  # the default stream, untouched by the fork
    tracker.set_states(state)
    with tracker.fork():
        assert torch.equal(split, F.dropout(x, 0.5, training=True))
    assert tensor_parallel_dropout(x, 0.5, False, None, "split") is x  # eval: identity, no tracker needed
    with pytest.raises(ValueError, match="needs the model-parallel RNG tracker"):
        tensor_parallel_dropout(x, 0.5, True, None, "split")
    with pytest.raises(ValueError, match="region must be 'split', 'replicated' or 'sequence', got 'tensor'"):
        TensorParallelDropout(0.1, tracker, "tensor")  # type: ignore[arg-type]
