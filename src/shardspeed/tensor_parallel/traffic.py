"""Expected tensor-parallel traffic of one transformer block, in the comms log's own terms (pure arithmetic).

[Note: tensor-parallel traffic] For activations of ``b·s·h`` elements (``A`` below) and a tensor axis of ``n``:
- without sequence parallelism, a block has two tensor-parallel regions (attention, MLP), each entered through
  ``f`` and left through ``g``: forward 2 all-reduces of ``A`` (``tp.g.forward``), backward 2 all-reduces of ``A``
  (``tp.f.backward``). Algorithmic traffic per rank: ``2·2(n-1)/n·A`` each way.
- with sequence parallelism (Megatron-SP) each ``g`` becomes a reduce-scatter (``sp.g.forward``) and each ``f`` an
  all-gather (``sp.f.forward``): forward 2 all-gathers + 2 reduce-scatters of ``A`` (logged at their unsharded
  size), i.e. ``4(n-1)/n·A`` — the same as the 2 all-reduces they replace. Backward is the mirror image: the
  column layers' ``f̄`` reduce-scatters its input gradient (``sp.f.backward``), the row layers' ``ḡ`` all-gathers
  the output gradient (``sp.g.backward``). **Re-gathers: none.** Our column-parallel layer lets autograd save the
  *gathered* input for its weight gradient, so backward needs no second all-gather. Megatron instead saves only the
  sequence shard and re-gathers it in backward (one more all-gather of ``A`` per column layer, 2 per block,
  overlapped with the input-gradient matmul): more traffic, less activation memory (``A`` instead of ``A/n`` saved
  per column layer).
- separate q/k/v column layers (``qkv_layers=3``) each enter the region on their own: attention's ``f`` (or ``f̄``)
  then costs 3 collectives of ``A`` instead of 1. A fused QKV (``parts=3``) is the Megatron layout.
- under sequence parallelism the replicated parameters inside the region (layer norms, row-parallel biases) have
  partial gradients, summed over the tensor axis once per backward pass (``tp.partial_grad``: all-reduces of the
  parameters' sizes; ``partial_grads.py``). That is parameter traffic, listed apart from the activations'.
Outside the block (not in its figure): entering the sequence region after the embedding costs an all-gather of the
gradient in backward (``sp.scatter.backward``); leaving it before the head an all-gather of ``A`` forward
(``sp.leave.forward``) and, with a tensor-parallel head, a reduce-scatter backward (``sp.leave.backward``);
vocab-parallel embedding / cross-entropy have their own tags; activation recompute repeats the block's forward
collectives once more in backward.
The figures are exact: the comms log records the same message sizes (``comm/log.py``), and a test compares them.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardspeed.comm.log import ALGORITHMIC_FACTOR


@dataclass(frozen=True)
class Expected:
    """``count`` collectives ``op`` tagged ``tag``, ``elements`` in all (unsharded message sizes, as logged)."""

    op: str
    tag: str
    count: int
    elements: int

    @property
    def key(self) -> str:
        """The comms log's key for these calls (``CommsLog.totals``)."""
        return f"{self.op}:{self.tag}"

    def algorithmic_elements(self, tp_size: int) -> float:
        return self.elements * ALGORITHMIC_FACTOR[self.op](tp_size)


@dataclass(frozen=True)
class Traffic:
    """Collectives by phase; ``by_key()`` is what a comms log holds after one forward + backward."""

    forward: tuple[Expected, ...]
    backward: tuple[Expected, ...]
    partial_grads: tuple[Expected, ...] = ()

    def all(self) -> tuple[Expected, ...]:
        return self.forward + self.backward + self.partial_grads

    def by_key(self) -> dict[str, tuple[int, int]]:
        """``"op:tag"`` → (calls, elements), summed over phases."""
        out: dict[str, tuple[int, int]] = {}
        for e in self.all():
            count, elements = out.get(e.key, (0, 0))
            out[e.key] = (count + e.count, elements + e.elements)
        return out

    def activation_elements(self) -> int:
        return sum(e.elements for e in self.forward + self.backward)

    def algorithmic_elements(self, tp_size: int, *, activations_only: bool = False) -> float:
        chosen = self.forward + self.backward if activations_only else self.all()
        return sum(e.algorithmic_elements(tp_size) for e in chosen)

    def scaled(self, times: int) -> Traffic:
        """The traffic of ``times`` identical blocks."""

        def mul(es: tuple[Expected, ...]) -> tuple[Expected, ...]:
            return tuple(Expected(e.op, e.tag, e.count * times, e.elements * times) for e in es)

        return Traffic(mul(self.forward), mul(self.backward), mul(self.partial_grads))


def block_traffic(
    batch: int,
    seq: int,
    hidden: int,
    tp_size: int,
    *,
    sequence_parallel: bool,
    qkv_layers: int = 1,
    partial_grad_numels: tuple[int, ...] = (),
) -> Traffic:
    """One transformer block's forward + backward ([Note: tensor-parallel traffic]). ``qkv_layers``: 1 for a
    fused QKV, 3 for separate q/k/v column layers. ``partial_grad_numels``: under sequence parallelism, the sizes
    of the block's partial-gradient parameters (e.g. ``(h, h, h, h, h, h)`` for two affine layer norms and two
    row-parallel biases), one all-reduce each per backward."""
    if qkv_layers not in (1, 3):
        raise ValueError(f"qkv_layers is 1 (fused QKV) or 3 (separate q, k, v), got {qkv_layers}")
    if tp_size == 1:
        return Traffic((), ())
    a = batch * seq * hidden
    entries = qkv_layers + 1  # column layers entering a region: attention's q/k/v, the MLP's first layer
    if not sequence_parallel:
        return Traffic(
            forward=(Expected("all_reduce", "tp.g.forward", 2, 2 * a),),
            backward=(Expected("all_reduce", "tp.f.backward", entries, entries * a),),
        )
    partial = (
        (Expected("all_reduce", "tp.partial_grad", len(partial_grad_numels), sum(partial_grad_numels)),)
        if partial_grad_numels
        else ()
    )
    return Traffic(
        forward=(
            Expected("all_gather", "sp.f.forward", entries, entries * a),
            Expected("reduce_scatter", "sp.g.forward", 2, 2 * a),
        ),
        backward=(
            Expected("reduce_scatter", "sp.f.backward", entries, entries * a),
            Expected("all_gather", "sp.g.backward", 2, 2 * a),
        ),
        partial_grads=partial,
    )


def sequence_boundary_traffic(
    batch: int, seq: int, hidden: int, tp_size: int, *, head_is_tensor_parallel: bool = False
) -> Traffic:
    """Entering the sequence-parallel region after the embedding and leaving it before the head
    (``sequence.py``): not part of any block."""
    if tp_size == 1:
        return Traffic((), ())
    a = batch * seq * hidden
    backward = [Expected("all_gather", "sp.scatter.backward", 1, a)]
    if head_is_tensor_parallel:
        backward.append(Expected("reduce_scatter", "sp.leave.backward", 1, a))
    return Traffic(forward=(Expected("all_gather", "sp.leave.forward", 1, a),), backward=tuple(backward))
