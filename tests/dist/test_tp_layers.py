"""Tensor-parallel layers at world 2 against a dense reference built from the same global weights.

Each case builds the module twice — at tensor size 1 (the dense reference: every mapping is the identity) and at
tensor size 2 with each parameter loaded as its slice of the dense one — runs forward and backward of
``(y · w).sum()`` and compares the output, the input gradient and every parameter's gradient reassembled from the
ranks' slices. Under sequence parallelism the input and output are the rank's sequence chunk and the norms' and
row biases' partial gradients are summed by the engine's hook function (``register_partial_grad_hooks``).
"""

from __future__ import annotations

import itertools

import torch
from tp_block import TPMLP, TPAttention, TPBlock, dense_tp, gather_global, load_global

from shardspeed.params import ParamSpecs
from shardspeed.tensor_parallel import TensorParallel, register_partial_grad_hooks
from shardspeed.topology import MeshShape, Topology

TOL = 1e-6
B, S, H = 2, 4, 16


def _compare(build, tp: TensorParallel, seed: int) -> dict[str, float]:
    """Max (relative) difference per compared tensor between ``build(tp)`` and ``build(dense)``."""
    n, r = tp.size, tp.rank
    torch.manual_seed(seed)
    dense = build(dense_tp())
    tpm = build(tp)
    load_global(tpm, dense.state_dict(), tp)
    g = torch.Generator().manual_seed(seed + 1)
    x, w = torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)

    xd = x.clone().requires_grad_()
    yd = dense(xd)
    (yd * w).sum().backward()

    def local(t: torch.Tensor) -> torch.Tensor:  # this rank's sequence chunk under SP, else the whole tensor
        return t.chunk(n, dim=1)[r] if tp.sequence_parallel else t

    hooks = register_partial_grad_hooks(tpm, ParamSpecs.collect(tpm, r, n), tp.axis, tp.collectives)
    xt = local(x).clone().requires_grad_()
    yt = tpm(xt)
    (yt * local(w)).sum().backward()
    for h in hooks:
        h.remove()

    errors = {"output": _err(yt, local(yd)), "input.grad": _err(xt.grad, local(xd.grad))}
    grads = gather_global(tpm, {name: p.grad for name, p in tpm.named_parameters()}, tp)
    dense_grads = {name: p.grad for name, p in dense.named_parameters()}
    assert grads.keys() == dense_grads.keys()
    for name, grad in grads.items():
        errors[name] = _err(grad, dense_grads[name])
    return errors


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs difference, relative to the reference's magnitude where that exceeds 1 (a weight gradient sums
    b·s products: at |g| ~ 10 one fp32 rounding step is already ~1e-6)."""
    return ((got - want).abs().max() / want.abs().max().clamp(min=1.0)).item()


def _cases(rank: int, world: int, kind: str) -> dict[str, dict[str, float]]:
    topo = Topology.build(MeshShape(tensor=world))
    out: dict[str, dict[str, float]] = {}
    for seed, (sp, layout, bias, variant) in enumerate(
        itertools.product((False, True), ("out_in", "in_out"), (True, False), (0, 1))
    ):
        tp = TensorParallel.from_topology(topo, sequence_parallel=sp)
        if kind == "mlp":  # variant 0: ffn divisible by 2; 1: 13 (ceil chunks 7 + 6), plus gathered when not SP
            ffn = 24 if variant == 0 else 13

            def build(t, ffn=ffn, layout=layout, bias=bias, gathered=variant == 1 and not sp):
                return TPMLP(H, ffn, t, bias=bias, layout=layout, gathered=gathered)
        elif kind == "attention":  # variant 0: fused QKV (parts=3); 1: separate q, k, v

            def build(t, layout=layout, bias=bias, fused=variant == 0):
                return TPAttention(H, 4, t, fused=fused, bias=bias, layout=layout)
        else:  # a whole pre-LN block, norms declared by the block (0) or wrapped (1)

            def build(t, layout=layout, bias=bias, wrap=variant == 1):
                return TPBlock(H, 4, 13, t, bias=bias, layout=layout, wrap_norms=wrap)

        out[f"sp={sp} layout={layout} bias={bias} variant={variant}"] = _compare(build, tp, seed)
    return out


def _check(results: list[dict[str, dict[str, float]]]) -> None:
    for rank, cases in enumerate(results):
        assert len(cases) == 16
        for case, errors in cases.items():
            bad = {k: v for k, v in errors.items() if not v <= TOL}
            assert not bad, f"rank {rank}, {case}: {bad}"


def test_column_row_mlp_matches_dense(dist_run) -> None:
    _check(dist_run(_cases, 2, "mlp"))


def test_attention_fused_and_separate_qkv_match_dense(dist_run) -> None:
    _check(dist_run(_cases, 2, "attention"))


def test_sequence_parallel_block_matches_dense(dist_run) -> None:
    _check(dist_run(_cases, 2, "block"))


def _bytes(rank: int, world: int) -> dict[str, int]:
    tp = TensorParallel.from_topology(Topology.build(MeshShape(tensor=world)))
    block = TPBlock(H, 4, 13, tp, layout="in_out")
    return {name: p.numel() * p.element_size() for name, p in block.named_parameters()}


def test_per_rank_bytes_of_each_sliced_weight(dist_run) -> None:
    """ffn 13 at TP=2: ceil(13/2) = 7 on rank 0, the remainder 6 on rank 1; heads split evenly; replicated whole."""
    r0, r1 = dist_run(_bytes, 2)
    f = 4  # fp32
    assert r0["mlp.fc.weight"] == H * 7 * f and r1["mlp.fc.weight"] == H * 6 * f
    assert r0["mlp.fc.bias"] == 7 * f and r1["mlp.fc.bias"] == 6 * f
    assert r0["mlp.proj.weight"] == 7 * H * f and r1["mlp.proj.weight"] == 6 * H * f
    for r in (r0, r1):
        assert r["attn.qkv.weight"] == H * 3 * (H // 2) * f
        assert r["attn.out.weight"] == (H // 2) * H * f
        assert r["mlp.proj.bias"] == H * f and r["ln_1.weight"] == H * f
