"""Tensor-parallel layers at world 2 against a dense reference built from the same global weights.

Each case builds the module twice — at tensor size 1 (the dense reference: every mapping is the identity) and at
tensor size 2 with each parameter loaded as its slice of the dense one — runs forward and backward of
``(y · w).sum()`` and compares the output, the input gradient and every parameter's gradient reassembled from the
ranks' slices. Under sequence parallelism the input and output are the rank's sequence chunk and the norms' and
row biases' partial gradients are summed by the engine's hook function (``register_partial_grad_hooks``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from tp_block import TPMLP, TPAttention, TPBlock, dense_tp, gather_global, load_global

from shardspeed.params import ParamSpecs
from shardspeed.tensor_parallel import TensorParallel, register_partial_grad_hooks
from shardspeed.tensor_parallel.sequence import enter_sequence_parallel
from shardspeed.tensor_parallel.traffic import block_traffic, sequence_boundary_traffic
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
        else:  # a whole pre-LN block: norms declared by the block (0) or wrapped, column inputs re-gathered (1)

            def build(t, layout=layout, bias=bias, wrap=variant == 1):
                return TPBlock(H, 4, 13, t, bias=bias, layout=layout, wrap_norms=wrap, regather=wrap)

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


# --- through the engine: partial gradients summed before ZeRO sees them, and the traffic of one block -------------
STEPS, VOCAB, SEQ = 5, 32, 8


def _lm_batches(seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(0, VOCAB, (2, SEQ), generator=g))
            for _ in range(STEPS)]  # fmt: skip


def _engine_vs_dense(rank: int, world: int, sp: bool, stage: int, kind: str, clip: float) -> dict[str, float]:
    from parity import optimizer_config, torch_optimizer
    from tp_block import TPTinyLM

    from shardspeed.config import load_config
    from shardspeed.engine import ShardSpeedEngine

    lr = 1e-2 if kind == "adamw" else 5e-2
    topo = Topology.build(MeshShape(tensor=world))
    tp = TensorParallel.from_topology(topo, sequence_parallel=sp)
    torch.manual_seed(0)
    dense = TPTinyLM(dense_tp())
    model = TPTinyLM(tp)
    load_global(model, dense.state_dict(), tp)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": optimizer_config(kind, lr),
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage},
    }
    engine = ShardSpeedEngine(model, load_config(cfg, dp_world_size=1), topo)
    opt = torch_optimizer(kind, dense.parameters(), lr)
    for ids, labels in _lm_batches():
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
        opt.zero_grad()
        dense(ids, labels).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(dense.parameters(), clip)
        opt.step()
    engine.destroy()
    got = gather_global(model, {n: p.detach() for n, p in model.named_parameters()}, tp)
    want = dict(dense.named_parameters())
    return {n: (t - want[n].detach()).abs().max().item() for n, t in got.items()}


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "sp,stage,kind,clip",
    [
        (True, 0, "sgd", 0.0),
        (True, 2, "adamw", 0.0),
        pytest.param(True, 2, "sgd", 0.0, marks=SLOW),
        pytest.param(True, 0, "adamw", 0.0, marks=SLOW),
        pytest.param(False, 0, "sgd", 0.0, marks=SLOW),
        pytest.param(False, 2, "adamw", 0.0, marks=SLOW),
        pytest.param(True, 1, "adamw", 0.0, marks=SLOW),
        pytest.param(True, 3, "adamw", 0.0, marks=SLOW),
        pytest.param(True, 0, "adamw", 1.0, marks=SLOW),
        pytest.param(True, 2, "adamw", 1.0, marks=SLOW),
        pytest.param(False, 2, "adamw", 1.0, marks=SLOW),
    ],
)
def test_engine_trains_a_tensor_parallel_lm_like_the_dense_one(dist_run, sp: bool, stage: int, kind: str, clip: float):
    """TP=2 (world 2), 5 steps, ZeRO 0 and 2 (1 and 3: slow), with and without sequence parallelism, within 1e-5 of
    plain torch on the dense model. Fails without the partial-gradient hooks (the SP norms would get half their
    gradient)."""
    for rank, errors in enumerate(dist_run(_engine_vs_dense, 2, sp, stage, kind, clip)):
        bad = {n: e for n, e in errors.items() if not e <= 1e-5}
        assert not bad, f"rank {rank}: {bad}"


class _OneBlock(torch.nn.Module):
    def __init__(self, tp: TensorParallel, regather: bool) -> None:
        super().__init__()
        self.block = TPBlock(H, 4, 24, tp, regather=regather)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Every tensor rank gets the same batch (the engine checks the first one); under SP the block's input is
        # this rank's sequence chunk. Entering the region costs one all-gather in backward, tagged apart
        # ("sp.scatter.backward") and left out of the block's figure.
        if self.block.tp.sequence_parallel:
            x = enter_sequence_parallel(x, self.block.tp)
        return self.block(x).square().sum()


def _traffic(rank: int, world: int, sp: bool, whole_model: bool, regather: bool = False) -> dict[str, tuple[int, int]]:
    from tp_block import TPTinyLM

    from shardspeed.config import load_config
    from shardspeed.engine import ShardSpeedEngine

    topo = Topology.build(MeshShape(tensor=world))
    tp = TensorParallel.from_topology(topo, sequence_parallel=sp)
    torch.manual_seed(0)
    model = TPTinyLM(tp, h=H, ffn=24) if whole_model else _OneBlock(tp, regather)
    cfg = {"train_micro_batch_size_per_gpu": B, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "comms_logger": {"enabled": True}}  # fmt: skip
    engine = ShardSpeedEngine(model, load_config(cfg, dp_world_size=1), topo)
    engine.comms_log.reset()  # construction's own collectives (structure check, …) are not the block's
    if whole_model:
        ids = torch.randint(0, 32, (B, SEQ), generator=torch.Generator().manual_seed(1))
        loss = engine(ids, ids)
    else:
        x = torch.randn(B, SEQ, H, generator=torch.Generator().manual_seed(1))
        loss = engine(x)
    engine.backward(loss)
    totals = {k: (t.count, t.elements) for k, t in engine.comms_log.totals.items()}
    if not whole_model:
        totals.pop("all_gather:sp.scatter.backward", None)  # entering the region: not the block's traffic
    engine.destroy()
    return totals


@pytest.mark.parametrize("sp,regather", [(False, False), (True, False), pytest.param(True, True, marks=SLOW)])
def test_one_block_moves_exactly_the_theory(dist_run, sp: bool, regather: bool) -> None:
    """One block's forward + backward, counted by the engine's comms log, equals traffic.py by tag (fused QKV,
    b=2, s=8, h=16, TP=2): without SP 2 + 2 all-reduces of b·s·h; with SP 2 all-gathers + 2 reduce-scatters each
    way (no re-gathers; with ``regather_input`` 2 more all-gathers in backward) plus the partial-gradient sums of
    the two norms and two row biases (6 × h)."""
    expected = block_traffic(
        B, SEQ, H, 2, sequence_parallel=sp, partial_grad_numels=(H,) * 6, regather_input=regather
    ).by_key()
    for totals in dist_run(_traffic, 2, sp, False, regather):
        assert totals == expected


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True])
def test_model_traffic_is_blocks_plus_the_region_boundary(dist_run, sp: bool) -> None:
    """Two blocks plus, with SP, entering (after the embedding) and leaving (before the replicated head) the
    sequence region, tagged apart; the replicated embedding and cross-entropy communicate nothing."""
    blocks = block_traffic(B, SEQ, H, 2, sequence_parallel=sp, partial_grad_numels=(H,) * 6).scaled(2)
    expected = blocks.by_key()
    if sp:
        expected |= sequence_boundary_traffic(B, SEQ, H, 2).by_key()
    for totals in dist_run(_traffic, 2, sp, True):
        assert totals == expected


def _dropout_masks(rank: int, world: int) -> dict[str, bool]:
    import torch.distributed as dist

    from shardspeed.checkpointing import MODEL_PARALLEL_RNG, RNGStatesTracker
    from shardspeed.tensor_parallel.sequence import SequenceParallelDropout

    topo = Topology.build(MeshShape(tensor=world))
    out = {}
    for sp in (False, True):
        tp = TensorParallel.from_topology(topo, sequence_parallel=sp)
        tracker = RNGStatesTracker(torch.device("cpu"))
        tracker.add(MODEL_PARALLEL_RNG, 1000 + tp.rank)  # what model_parallel_manual_seed does: per tensor rank
        torch.manual_seed(0)  # the default stream: the same on every rank
        mask = (SequenceParallelDropout(0.5, tp, tracker)(torch.ones(4, 64)) == 0).float()
        masks = [torch.empty_like(mask) for _ in range(world)]
        dist.all_gather(masks, mask)
        out[f"sp={sp}"] = torch.equal(masks[0], masks[1])
    return out


def test_dropout_in_the_sequence_region_draws_a_mask_per_tensor_rank(dist_run) -> None:
    """Shards of different tokens get different masks; replicated activations (no SP) the same one."""
    for same in dist_run(_dropout_masks, 2):
        assert same == {"sp=False": True, "sp=True": False}


def _recompute(rank: int, world: int, sp: bool) -> dict[str, tuple[int, int]]:
    from shardspeed.checkpointing import CheckpointingContext
    from shardspeed.comm import Collectives, CommsLog

    tp = TensorParallel.from_topology(Topology.build(MeshShape(tensor=world)), sequence_parallel=sp)
    tp.bind(Collectives(CommsLog(enabled=True)))
    block = TPBlock(H, 4, 24, tp)
    x = torch.randn(B, SEQ // (world if sp else 1), H, generator=torch.Generator().manual_seed(1))
    CheckpointingContext(configured=False).checkpoint(block, x).square().sum().backward()
    return {k: (t.count, t.elements) for k, t in tp.collectives.log.totals.items()}


@pytest.mark.parametrize("sp", [False, True])
def test_a_checkpointed_block_adds_the_recompute_traffic(dist_run, sp: bool) -> None:
    """Recompute is counted apart from the block's figure: block + recompute_traffic (the forward again, less the
    last row layer's reduction, which torch's early-stopping checkpoint never reruns). No partial-gradient hooks
    here (no engine), so no ``tp.partial_grad``."""
    from shardspeed.tensor_parallel.traffic import recompute_traffic

    expected = block_traffic(B, SEQ, H, 2, sequence_parallel=sp).by_key()
    for key, (count, elements) in recompute_traffic(B, SEQ, H, 2, sequence_parallel=sp).by_key().items():
        c, e = expected.get(key, (0, 0))
        expected[key] = (c + count, e + elements)
    for totals in dist_run(_recompute, 2, sp):
        assert totals == expected
