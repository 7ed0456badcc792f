"""[Note: 1-bit compression]: sign packing, the scale, error feedback, and the one-process references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shardspeed.compression import reference
from shardspeed.compression.signs import (
    average_chunks,
    average_rows_,
    compress_,
    compress_compensated_,
    decompress,
    pack_bits_,
    pack_signs,
    packed_size,
    padded_numel,
    scale_of,
    unpack_scaled_,
    unpack_signs,
)


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 63, 1000, 1001])
def test_pack_unpack_round_trip(numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    x[::5] = 0.0  # zero sends +1 (DeepSpeed: sign(x) + 1 as bool)
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_size(numel) == math.ceil(numel / 8)
    expected = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(unpack_signs(packed, numel), expected)
    # numpy's packbits order (DeepSpeed's packer): first element in the most significant bit, zero-padded
    assert packed.tolist() == np.packbits((x >= 0).numpy()).tolist()
    assert unpack_signs(packed, numel, torch.bfloat16).dtype == torch.bfloat16


def test_padding_bits_are_zero_and_unpack_checks_size() -> None:
    assert pack_signs(torch.ones(3)).tolist() == [0b11100000]
    with pytest.raises(ValueError, match="hold at most 8 signs"):
        unpack_signs(torch.zeros(1, dtype=torch.uint8), 9)


def test_scale_keeps_the_norm_and_compress_updates_the_error() -> None:
    x = torch.tensor([3.0, -4.0, 0.0, 1.0])
    assert scale_of(x).item() == pytest.approx(math.sqrt(26 / 4))
    error = torch.tensor([0.5, 0.5, -1.0, 0.0])
    compensated = x + error
    packed, scale = compress_(x, error)
    assert scale.item() == pytest.approx(torch.linalg.norm(compensated).item() / 2)
    sent = decompress(packed, scale, 4)
    assert torch.allclose(sent, scale * torch.tensor([1.0, -1.0, -1.0, 1.0]))
    assert torch.allclose(sent + error, compensated)  # what was sent + the new error = the compensated input
    assert torch.linalg.norm(sent).item() == pytest.approx(torch.linalg.norm(compensated).item(), rel=1e-6)
    with pytest.raises(ValueError, match="error buffer"):
        compress_(torch.zeros(3), torch.zeros(4))


def test_error_feedback_running_sum_tracks_the_inputs() -> None:
    """sum(sent) = sum(inputs) - error at every step: the gap is one error buffer, bounded, not growing."""
    g = torch.Generator().manual_seed(0)
    error, sum_in, sum_out, gaps = torch.zeros(4096), torch.zeros(4096), torch.zeros(4096), []
    for _ in range(200):
        x = torch.randn(4096, generator=g) + 0.3
        sum_in += x
        packed, scale = compress_(x.clone(), error)
        sum_out += decompress(packed, scale, 4096)
        gaps.append((torch.linalg.norm(sum_in - sum_out) / torch.linalg.norm(sum_in)).item())
        assert torch.allclose(sum_in - sum_out, error, atol=1e-3)
    assert max(gaps[100:]) < 0.05  # relative gap shrinks as the sums grow: the absolute one stays bounded
    no_feedback = torch.zeros(4096)
    for _ in range(200):  # without feedback, the gap grows with the steps
        x = torch.randn(4096, generator=g) + 0.3
        no_feedback += x - decompress(*compress_(x.clone(), torch.zeros(4096)), 4096)
    assert torch.linalg.norm(no_feedback) > 5 * torch.linalg.norm(error)


def test_average_chunks_is_the_mean_of_decompressed_copies() -> None:
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randn(16, generator=g) for _ in range(3)]
    packs = torch.stack([pack_signs(c) for c in chunks])
    scales = torch.cat([scale_of(c) for c in chunks])
    expected = sum(decompress(p, s, 16) for p, s in zip(packs, scales, strict=True)) / 3
    assert torch.allclose(average_chunks(packs, scales, 16), expected, atol=1e-6)


def test_padded_numel_is_deepspeeds_corrected_size() -> None:
    for world in (1, 2, 3, 4, 6, 8):
        divider = int(world * 8 / np.gcd(world, 8))  # OnebitAdam's divider
        for numel in (1, 100, 4096, 12345):
            size = numel + (world * divider - numel % (world * divider)) % (world * divider)
            assert padded_numel(numel, world) == size


def test_reference_allreduce_single_worker_is_exact_and_tracks_the_mean() -> None:
    x = torch.randn(1000)
    assert torch.equal(reference.compressed_allreduce([x], [torch.zeros(0)], [torch.zeros(0)]), x)
    n, numel, steps = 4, 1000, 100
    padded = padded_numel(numel, n)
    we, se = [torch.zeros(padded) for _ in range(n)], [torch.zeros(padded // n) for _ in range(n)]
    g = torch.Generator().manual_seed(2)
    sum_mean, sum_out = torch.zeros(numel), torch.zeros(numel)
    for _ in range(steps):
        xs = [torch.randn(numel, generator=g) + 1.0 for _ in range(n)]
        sum_mean += torch.stack(xs).mean(0)
        sum_out += reference.compressed_allreduce(xs, we, se)
    assert (torch.linalg.norm(sum_out - sum_mean) / torch.linalg.norm(sum_mean)).item() < 0.05


def test_reference_reduce_scatter_slices_track_the_mean() -> None:
    n, numel = 2, 30  # slices of 15: padded to 16 each
    we = [torch.zeros(n * 16) for _ in range(n)]
    g = torch.Generator().manual_seed(3)
    sum_mean, sum_out = torch.zeros(numel), torch.zeros(numel)
    for _ in range(200):
        xs = [torch.randn(numel, generator=g) + 1.0 for _ in range(n)]
        sum_mean += torch.stack(xs).mean(0)
        sum_out += torch.cat(reference.compressed_reduce_scatter(xs, we))
    assert (torch.linalg.norm(sum_out - sum_mean) / torch.linalg.norm(sum_mean)).item() < 0.05


def test_negative_zero_sends_plus_one_like_deepspeed() -> None:
    """DeepSpeed: ``sign(x) + 1`` as bool, so -0.0 is +1 and its error is ``-0.0 - scale``."""
    x, error = torch.tensor([-0.0, 2.0, -2.0, 0.0]), torch.tensor([-0.0, 0.0, 0.0, 0.0])
    packed, scale = compress_(x, error)
    assert unpack_signs(packed, 4).tolist() == [1.0, 1.0, -1.0, 1.0]
    s = scale.item()
    assert error.tolist() == [-s, 2.0 - s, -2.0 + s, -s]


def test_hot_path_kernels_equal_the_plain_forms() -> None:
    """[Note: compressed hot path]: the in-place packer, the table-gather unpacking into ±scale, and the server
    average through preallocated rows give the bits of the plain forms (masks, multiplies, an fp32 sum)."""
    g = torch.Generator().manual_seed(7)
    bits = torch.rand(8 * 123, generator=g) < 0.5
    plain = (bits.view(-1, 8).to(torch.int64) * (1 << torch.arange(7, -1, -1))).sum(1).to(torch.uint8)
    assert torch.equal(pack_bits_(bits, torch.empty(123, dtype=torch.uint8)), plain)
    scale = torch.tensor([0.37])
    out = unpack_scaled_(plain, scale, torch.empty(8 * 123)).view(-1)  # CPU fp32: numpy's take
    assert torch.equal(out, torch.where(bits, scale, -scale))
    wide = torch.stack([plain, plain.flip(0)], 1)  # (123, 2): column 0 is a strided view of the same bytes
    assert torch.equal(unpack_scaled_(wide[:, 0], scale, torch.empty(8 * 123)).view(-1), out)
    out64 = unpack_scaled_(plain, scale.double(), torch.empty(8 * 123, dtype=torch.float64)).view(-1)  # torch's
    assert torch.equal(out64, torch.where(bits, scale.double(), -scale.double()))
    for n in (2, 3, 5):
        packed = torch.randint(0, 256, (n, 17), dtype=torch.uint8, generator=g)
        scales = torch.rand(n, generator=g)
        rows = torch.stack([unpack_signs(packed[r], 136) for r in range(n)])
        expected = rows.mul_(scales.view(n, 1).mul(1 / n)).sum(0)[:130]
        got = average_rows_(packed, scales, torch.empty(n, 136), torch.empty(130))
        assert torch.equal(got, expected)


def test_compensated_compression_equals_compress_and_loaded_negative_zero_is_normalized() -> None:
    """The collective's path (input added into the error buffer, then compressed there) equals ``compress_``;
    a loaded error buffer holding -0.0 is stored as +0.0 ([Note: no negative zero])."""
    g = torch.Generator().manual_seed(3)
    x, error = torch.randn(64, generator=g), torch.randn(64, generator=g) * 0.1
    x[3], error[3] = -0.0, 0.0
    plain_error = error.clone()
    packed, scale = compress_(x.clone(), plain_error)
    fused, out = error.clone().add_(x), torch.empty(8, dtype=torch.uint8)
    fused_scale = compress_compensated_(fused, out, torch.empty(64, dtype=torch.bool), torch.empty(64))
    assert torch.equal(out, packed) and torch.equal(fused_scale, scale) and torch.equal(fused, plain_error)
    from shardspeed.compression.collective import CompressedReduceScatter

    class _One:  # an axis of size 2 is all the constructor needs; nothing communicates here
        name, size = "data", 2

    rs = CompressedReduceScatter(16, _One(), None, device=torch.device("cpu"))  # type: ignore[arg-type]
    rs.load_state_dict({**rs.state_dict(), "worker_error": torch.full((16,), -0.0)})
    assert not torch.signbit(rs.worker_error).any()


@pytest.mark.parametrize("numel", [64, 65536, 3 * 65536 + 40])
def test_cpu_numpy_sweep_equals_the_torch_sweep_bit_for_bit(numel: int) -> None:
    """[Note: CPU sweep in numpy]: the numpy sweep CPU fp32 takes packs the same bytes and leaves the same error
    bits as the torch sweep other devices take, across block boundaries, with zeros, infinities and a NaN."""
    from shardspeed.compression import signs

    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g)
    x[::13], x[5], x[9], x[10] = 0.0, float("nan"), float("inf"), -float("inf")
    results = []
    for sweep in (signs._sweep_numpy_, signs._sweep_torch_):
        xs, packed = x.clone(), torch.empty(numel // 8, dtype=torch.uint8)
        bits, scratch = torch.empty(min(numel, signs.BLOCK), dtype=torch.bool), torch.empty(min(numel, signs.BLOCK))
        sweep(xs, packed, bits, scratch, torch.tensor([0.75]))
        results.append((packed, xs.view(torch.int32)))
    (np_packed, np_error), (t_packed, t_error) = results
    assert torch.equal(np_packed, t_packed)
    nan = torch.isnan(x)
    assert torch.equal(np_error[~nan], t_error[~nan]) and torch.isnan(results[0][1].view(torch.float32)[nan]).all()
    assert torch.equal(np_packed, pack_signs(x))  # and both are the plain packer's bytes


@pytest.mark.parametrize("n,numel", [(1, 100), (2, 3 * 65536 + 13), (2, 1003), (2, 70000)])
def test_cpu_numpy_server_average_equals_the_torch_one_bit_for_bit(n: int, numel: int) -> None:
    """``average_rows_`` on CPU fp32 with N ≤ 2 (numpy) gives the torch path's mean and server-error bits, over
    strided packed rows, a partial last block and a partial byte; more rows are refused (torch's dim-0 sum of 8+
    rows is not sequential, so larger N stay on torch)."""
    from shardspeed.compression import signs

    g = torch.Generator().manual_seed(n * numel)
    nbytes = -(-numel // 8)
    wide = torch.randint(0, 256, (n, nbytes + 5), dtype=torch.uint8, generator=g)
    packed = wide[:, 3 : 3 + nbytes]  # rows strided, as a partwise call's column range
    scales = torch.rand(n, generator=g) * 10
    weights = scales.mul(1 / n)
    tables = [signs._bit_table(torch.float32, torch.device("cpu")) * weights[r] for r in range(n)]
    results = []
    for numpy_path in (True, False):
        rows, out = torch.empty(n, signs.BLOCK), torch.empty(numel)
        error = torch.randn(numel, generator=torch.Generator().manual_seed(1))
        if numpy_path:
            signs._average_rows_numpy_(packed, tables, rows, out, error)
        else:
            signs._average_rows_torch_(packed, tables, rows, out, torch.empty(nbytes, dtype=torch.int32), error)
        results.append((out.view(torch.int32), error.view(torch.int32)))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    expected = (unpack_signs(packed.contiguous().view(-1), n * nbytes * 8).view(n, -1) * weights.view(n, 1)).sum(0)
    assert torch.equal(results[0][0].view(torch.float32), expected[:numel])  # DeepSpeed's unpack · w, then sum(0)


def test_numpy_server_average_refuses_more_than_two_rows() -> None:
    from shardspeed.compression import signs

    tables = [signs._bit_table(torch.float32, torch.device("cpu"))] * 3
    with pytest.raises(ValueError, match="at most 2 rows"):
        signs._average_rows_numpy_(
            torch.zeros(3, 1, dtype=torch.uint8), tables, torch.empty(3, 8), torch.empty(8), None
        )
