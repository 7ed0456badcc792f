"""Compute per phase of the compressed all-reduce ([Note: compressed hot path]), one process playing one rank.

    python benchmarks/bench_compression_phases.py [--log2-sizes 20,22,24] [--world 2] [--repeats 7]

No communication: the received bytes are random, so the figures are the element-wise work alone, single thread.
Phases: worker (input added into the error buffer, norm, blocked sign/pack/error sweep), server (N table gathers
summed and added into the server error, then recompression of the chunk), final unpack (the N server chunks
gathered into the output). Printed: median ms [IQR] per phase and in total, next to the fp32 ring all-reduce's
wire time for the same elements at 1 and 10 Gbit/s (2 (N-1)/N × 4 bytes per element), the budget compression has
to beat on such a link.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from stats import interquartile_range, median

from shardspeed.compression import signs as S


def phases(numel: int, world: int) -> dict[str, Callable[[], object]]:
    padded = S.padded_numel(numel, world)
    chunk = padded // world
    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g)
    worker_error, server_error = torch.zeros(padded), torch.zeros(chunk)
    packed = torch.empty(padded // 8, dtype=torch.uint8)
    bits, floats = torch.empty(S.BLOCK, dtype=torch.bool), torch.empty(world * S.BLOCK)
    index, mean, out = torch.empty(padded // 8, dtype=torch.int32), torch.empty(chunk), torch.empty(numel)
    received = torch.randint(0, 256, (world, chunk // 8), dtype=torch.uint8, generator=g)
    scales = torch.rand(world, generator=g)

    def worker() -> object:
        worker_error[:numel].add_(x)
        return S.compress_compensated_(worker_error, packed, bits, floats)

    def server() -> object:
        S.average_rows_(received, scales, floats.view(world, -1), mean, index, add_to=server_error)
        return S.compress_compensated_(server_error, packed[: chunk // 8], bits, floats)

    def unpack() -> object:
        for r in range(world):
            lo, hi = r * chunk, min((r + 1) * chunk, numel)
            S.unpack_scaled_(received[r, : (hi - lo) // 8], scales[r], out[lo:hi], index[: (hi - lo) // 8])
        return out

    return {"worker compress+pack": worker, "server average+recompress": server, "final unpack": unpack}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log2-sizes", default="20,22,24", help="log2 of the bucket's elements (default 20,22,24)")
    parser.add_argument("--world", type=int, default=2, help="ranks the chunks are split over (default 2)")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats (default 7)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"bench_compression_phases: world {args.world}, one thread, torch {torch.__version__}; ms median [IQR]")
    for lg in (int(v) for v in args.log2_sizes.split(",")):
        numel = 1 << lg
        # numel a multiple of 8 · world: the unpack phase needs no partial bytes
        steps = phases(numel, args.world)
        times: dict[str, list[float]] = {name: [] for name in steps}
        totals: list[float] = []
        for _ in range(args.repeats):
            total = 0.0
            for name, fn in steps.items():
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1e3)
                total += times[name][-1]
            totals.append(total)
        for name, values in [*times.items(), ("total", totals)]:
            q25, q75 = interquartile_range(values)
            print(f"2^{lg:<3} {name:<27} {median(values):9.1f} ms  [{q25:.1f}, {q75:.1f}]")
        wire = 2 * (args.world - 1) / args.world * 4 * numel * 8
        at_1, at_10 = wire / 1e9 * 1e3, wire / 1e10 * 1e3
        print(f"2^{lg:<3} fp32 ring all-reduce wire: {at_1:.1f} ms at 1 Gbit/s, {at_10:.1f} at 10")


if __name__ == "__main__":
    main()
