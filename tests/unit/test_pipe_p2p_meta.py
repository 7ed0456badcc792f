"""The pipeline message header and partitioned slices (pure: pipe/p2p_meta.py, [Note: pipeline message framing])."""

from __future__ import annotations

import pytest
import torch

from shardspeed.pipe.p2p_meta import (
    DTYPE_CODES,
    HEADER_SLOTS,
    MAGIC,
    TensorMeta,
    decode_header,
    describe,
    encode_header,
    is_partitioned,
    partition_slice,
    stream_checksum,
)


def test_header_round_trip_mixed_tuple() -> None:
    tensors = (
        torch.randn(2, 3, 4, requires_grad=True),
        torch.ones(2, 3, dtype=torch.int64),  # a mask
        torch.zeros(5, dtype=torch.bool),
        torch.tensor(1.5),  # 0-d, no grad
        torch.empty(0, 7, dtype=torch.bfloat16, requires_grad=True),
    )
    metas = describe(tensors, "test")
    values = encode_header(metas, "act")
    assert len(values) == HEADER_SLOTS
    assert values[:3] == [MAGIC, stream_checksum("act"), 5]
    assert values[3:10] == [DTYPE_CODES[torch.float32], 1, 3, 2, 3, 4, DTYPE_CODES[torch.int64]]
    assert decode_header(values, "act", 1) == metas
    assert metas[3] == TensorMeta(torch.float32, (), False)
    assert metas[4].numel == 0 and metas[4].requires_grad


def test_requires_grad_kept_only_for_float() -> None:
    (meta,) = describe((torch.randn(3).requires_grad_(),), "x")
    assert meta.requires_grad
    (meta,) = describe((torch.randn(3),), "x")
    assert not meta.requires_grad


@pytest.mark.parametrize(
    ("message", "culprit"),
    [
        ((torch.ones(1), None), "element 1 of the tuple is NoneType"),
        ((torch.ones(1), 3), "element 1 of the tuple is int"),
    ],
)
def test_describe_refuses_non_tensors_naming_position(message: tuple, culprit: str) -> None:
    with pytest.raises(TypeError, match=culprit):
        describe(message, "PipeChannel.send to rank 1")


def test_describe_refuses_bare_tensor_and_empty_tuple() -> None:
    with pytest.raises(TypeError, match="expected a tuple of tensors, got Tensor"):
        describe(torch.ones(2), "send")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty tuple"):
        describe((), "send")


def test_header_capacity_error_names_stream() -> None:
    metas = describe(tuple(torch.ones(1, 1, 1, 1, 1) for _ in range(8)), "x")
    with pytest.raises(ValueError, match="stream 'act' needs a 67-value header"):
        encode_header(metas, "act")


def test_framing_errors() -> None:
    values = encode_header(describe((torch.ones(2),), "x"), "act")
    with pytest.raises(RuntimeError, match="header of another stream"):
        decode_header(values, "grad", 1)
    with pytest.raises(RuntimeError, match="expected the meta header of stream 'act' from rank 3"):
        decode_header([7] * HEADER_SLOTS, "act", 3)


def test_partition_slices_cover_padded_tensor() -> None:
    assert [partition_slice(10, 4, i) for i in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 3)]
    assert partition_slice(8, 2, 1) == (4, 4)
    float_meta = TensorMeta(torch.float32, (3,), True)
    assert is_partitioned(float_meta, 2) and is_partitioned(float_meta, 3)
    assert not is_partitioned(float_meta, 4)  # fewer elements than tensor ranks: whole
    assert not is_partitioned(TensorMeta(torch.int64, (8,), False), 2)  # masks whole
    assert not is_partitioned(float_meta, 1)
    with pytest.raises(ValueError):
        partition_slice(8, 2, 2)
