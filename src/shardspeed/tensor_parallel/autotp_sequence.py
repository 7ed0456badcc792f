"""Sequence parallelism for a model AutoTP sliced: where the sequence-split region starts and ends, and its norms.

[Note: AutoTP sequence parallelism] Megatron-SP ([Note: sequence-parallel regions] in sequence.py) needs three
things the model's own code does not do; AutoTP adds them from outside, without editing the model's forward:
- **enter** the region at the first transformer block's input (a forward pre-hook on ``blocks[0]`` replacing its
  ``hidden_states`` by this rank's sequence chunk). That is *after* the embeddings and their dropout, and — unlike
  splitting the embedding output itself — after the model read the sequence length for positions, the causal mask
  and rotary tables, which must stay full-length: attention runs on the whole sequence (the column-parallel q/k/v
  projections all-gather it);
- **leave** it after the final norm (a forward hook on ``ln_f`` / ``norm`` all-gathering the sequence), so the
  LM head and the loss see every token as in the dense model;
- declare every norm inside the region (the blocks' and the final one) as having a *partial* gradient (each rank
  normalises only its tokens): the norm modules are replaced by ``SequenceParallelLayerNorm`` /
  ``SequenceParallelRMSNorm``, which hold the *same* parameter objects under the same names (state-dict keys do
  not change) and declare ``partial_grad`` specs; the engine sums those gradients over the tensor axis
  (partial_grads.py). Row-parallel biases declare themselves (layers.py).
Traffic (a test counts it): attention costs one all-gather of ``A = b·s·h`` forward at the module and one
all-reduce of ``A`` per q/k/v column layer backward (their ``f``) — where Megatron's own fused-QKV layer pays one
reduce-scatter; the MLP and the row layers are Megatron's (``f̄`` / ``ḡ``); no re-gathers (the gathered inputs are
saved, as in layers.py).
Any other replicated parameter inside the blocks would silently get a partial gradient, so it is an error; so is a
norm class whose arithmetic is not known here (Gemma's ``1 + weight`` RMSNorm, for one).
Dropout inside the blocks (GPT-2's residual and attention dropout, 0.1 by default) draws a different mask per tensor
rank from a stream derived per block call ([Note: AutoTP block dropout streams] in autotp_dropout.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardspeed.params.spec import ParamSpec
from shardspeed.tensor_parallel.autotp_dropout import blocks_have_dropout, install_block_streams
from shardspeed.tensor_parallel.context import TensorParallel
from shardspeed.tensor_parallel.mappings import gather_from_sequence_region
from shardspeed.tensor_parallel.plan import PlanError
from shardspeed.tensor_parallel.sequence import enter_sequence_parallel, leave_sequence_parallel, partial_grad_specs

FINAL_NORM_NAMES: tuple[str, ...] = ("ln_f", "norm", "final_layernorm", "final_norm")
RMS_NORM_CLASSES: frozenset[str] = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})
"""Hugging Face RMSNorms computing ``weight * (x·rsqrt(mean(x²) + eps)).to(dtype)`` in fp32 (LLaMA's formula)."""


class SequenceParallelLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` run on sequence shards: declares its parameters' gradients partial over the tensor axis."""

    def __init__(self, norm: nn.LayerNorm, tp: TensorParallel) -> None:
        super().__init__(norm.normalized_shape, eps=norm.eps, elementwise_affine=False, bias=False)
        self.elementwise_affine = norm.elementwise_affine
        self.weight, self.bias = norm.weight, norm.bias  # the same Parameters: keys and optimizer groups unchanged
        self.tp = tp

    def tensor_parallel_specs(self) -> dict[str, ParamSpec]:
        return partial_grad_specs(self, "", self.tp)


class SequenceParallelRMSNorm(nn.Module):
    """A LLaMA-family RMSNorm run on sequence shards (the same arithmetic as ``LlamaRMSNorm``)."""

    def __init__(self, norm: nn.Module, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        self.tp = tp

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def tensor_parallel_specs(self) -> dict[str, ParamSpec]:
        return partial_grad_specs(self, "", self.tp)


def _sequence_norm(norm: nn.Module, name: str, tp: TensorParallel | None) -> nn.Module | None:
    """The replacement of ``norm`` (None when only checking: ``tp`` None); unknown norm classes are an error."""
    if type(norm) is nn.LayerNorm:
        return SequenceParallelLayerNorm(norm, tp) if tp is not None else None
    if type(norm).__name__ in RMS_NORM_CLASSES:
        return SequenceParallelRMSNorm(norm, tp) if tp is not None else None
    raise PlanError(
        f"sequence parallelism: '{name}' is a {type(norm).__name__}, whose arithmetic AutoTP does not know "
        f"(it handles nn.LayerNorm and {', '.join(sorted(RMS_NORM_CLASSES))}); turn sequence_parallel off"
    )


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def find_blocks(model: nn.Module, sliced: list[str]) -> tuple[str, nn.ModuleList]:
    """The ``nn.ModuleList`` of transformer blocks holding every sliced layer (``transformer.h``, ``model.layers``)."""
    found = [
        (name, module)
        for name, module in model.named_modules()
        if name and isinstance(module, nn.ModuleList) and all(s.startswith(f"{name}.") for s in sliced)
    ]
    if not found:
        raise PlanError(
            "sequence parallelism: the sliced layers do not all sit in one list of transformer blocks "
            f"({', '.join(sliced[:4])}, ...); AutoTP cannot tell where the sequence-split region starts"
        )
    return max(found, key=lambda item: len(item[0]))  # the innermost list


@dataclass(frozen=True)
class SequencePlan:
    """Where the region starts and ends and which norms it holds (checked; nothing changed yet)."""

    blocks_name: str
    final_norm: str
    norms: tuple[str, ...]
    """Every norm inside the region, the final one last."""
    attention: tuple[str, ...]
    """Attention modules owning sliced column layers: their input is gathered at the module ([Note: AutoTP
    sequence parallelism])."""
    dropout: bool = False
    """Something inside the blocks drops out: each block call gets a per-tensor-rank stream ([Note: AutoTP block
    dropout streams])."""


def plan_sequence_parallel(model: nn.Module, sliced: list[str]) -> SequencePlan:
    """Check that AutoTP can run ``model`` sequence-parallel ([Note: AutoTP sequence parallelism]); ``sliced``: the
    names of the layers about to be sliced (still dense here)."""
    blocks_name, blocks = find_blocks(model, sliced)
    parent_name = blocks_name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    final = [n for n in FINAL_NORM_NAMES if isinstance(getattr(parent, n, None), nn.Module)]
    if len(final) != 1 or not _is_norm(getattr(parent, final[0])):
        raise PlanError(
            f"sequence parallelism: no final norm ({' / '.join(FINAL_NORM_NAMES)}) beside '{blocks_name}'; AutoTP "
            "cannot tell where the sequence-split region ends"
        )
    final_name = f"{parent_name}.{final[0]}" if parent_name else final[0]
    norms: list[str] = []
    skip = tuple(f"{s}." for s in sliced)
    for name, module in blocks.named_modules(prefix=blocks_name):
        if name in sliced or name.startswith(skip):
            continue
        if _is_norm(module):
            norms.append(name)
            _sequence_norm(module, name, None)  # refuses unknown norm classes now, before anything changes
            continue
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if own and not any(name.startswith(f"{n}.") for n in norms):
            raise PlanError(
                f"sequence parallelism: '{name}' ({type(module).__name__}) holds replicated parameters {own} inside "
                "the sequence-split blocks; AutoTP only knows norms there (turn sequence_parallel off)"
            )
    _sequence_norm(model.get_submodule(final_name), final_name, None)
    attention = sorted(
        {s.rpartition(".")[0] for s in sliced if _is_attention(model.get_submodule(s.rpartition(".")[0]))}
    )
    dropout = blocks_have_dropout(model, blocks)
    return SequencePlan(blocks_name, final_name, (*norms, final_name), tuple(attention), dropout)


def _is_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention")


def apply_sequence_parallel(model: nn.Module, tp: TensorParallel, plan: SequencePlan) -> list[Any]:
    """Replace the region's norms and add the enter/leave hooks; returns the hook handles."""
    for name in plan.norms:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        setattr(owner, attr, _sequence_norm(getattr(owner, attr), name, tp))
    blocks = model.get_submodule(plan.blocks_name)
    return [
        blocks[0].register_forward_pre_hook(_enter(tp), with_kwargs=True),
        model.get_submodule(plan.final_norm).register_forward_hook(_leave(tp)),
        *(model.get_submodule(n).register_forward_pre_hook(_gather(tp), with_kwargs=True) for n in plan.attention),
        *(install_block_streams(blocks, tp) if plan.dropout else []),
    ]


def attention_twin(tp: TensorParallel) -> TensorParallel:
    """The context of the column layers inside a gathered attention module: same axis and collectives, no sequence
    parallelism (their input is already whole; their input gradient is all-reduced, ``f``)."""
    return TensorParallel(tp.axis, tp.collectives, sequence_parallel=False, tracker=tp.tracker)


def _on_hidden_states(fn):
    """A forward pre-hook applying ``fn`` to the module's ``hidden_states`` (first positional argument or kwarg)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}

    return hook


def _enter(tp: TensorParallel):
    return _on_hidden_states(lambda x: enter_sequence_parallel(x, tp))


ATTENTION_GATHER_TAG = "sp.attention"


def _gather(tp: TensorParallel):
    # The gradient reaching the gathered input is whole on every rank (the column layers' f all-reduced it), so the
    # backward keeps this rank's chunk (no communication): tensor_parallel_output_grad=False.
    return _on_hidden_states(
        lambda x: gather_from_sequence_region(x, tp, 1, tensor_parallel_output_grad=False, tag=ATTENTION_GATHER_TAG)
    )


def _leave(tp: TensorParallel):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return leave_sequence_parallel(output, tp)

    return hook
