"""AutoTP: slice an existing model's linear layers in place, following a plan (``plan.py``, ``hf_plans.py``).

``apply_tensor_parallel(model, tp, settings)`` replaces every ``nn.Linear`` / Hugging Face ``Conv1D`` the plan
assigns a style by a ``ColumnParallelLinear`` / ``RowParallelLinear`` holding this rank's slice of the dense
weight (``load_dense``), under the *same attribute name*, so state-dict keys stay the model's own (HF's
``save_pretrained`` keys, loadable by the unsliced model once gathered). Conv1D keeps its ``[in, out]`` layout.

Attention modules count heads locally after slicing: HF reshapes q/k/v with ``-1`` heads in 4.57 LLaMA, but GPT-2
splits its fused QKV output at ``split_size`` and older/other models keep ``num_heads`` / ``num_key_value_heads``
attributes; those integers are divided by the tensor-parallel size on the modules that own a sliced layer. Heads
and key-value heads must divide evenly (an error naming the model's numbers otherwise): a head is never split.

With ``sequence_parallel`` the blocks' activations are split along the sequence: autotp_sequence.py.

Not handled (errors, not silent wrongness): models built under ``zero.Init`` (meta parameters: there is no dense
weight to slice yet), a sliced weight shared with another module (tied), ``vocab`` rules (vocab-parallel embeddings
come with ``VocabParallelEmbedding``). Hooks registered on a replaced module do not carry over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardspeed.tensor_parallel.autotp_sequence import (
    apply_sequence_parallel,
    attention_twin,
    plan_sequence_parallel,
)
from shardspeed.tensor_parallel.context import TensorParallel
from shardspeed.tensor_parallel.hf_plans import model_type_of, resolve_plan
from shardspeed.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from shardspeed.tensor_parallel.plan import PlanError, PlanRule

if TYPE_CHECKING:
    from shardspeed.config.tensor_parallel import TensorParallelConfig

HEAD_COUNT_ATTRS: tuple[str, ...] = ("num_heads", "num_key_value_heads", "split_size")
"""Per-module integers that count (heads of) this rank's slice after slicing; divided by the TP size."""


def is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a linear layer storing its weight ``[in, out]`` (recognised without
    importing transformers, which stays optional)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and isinstance(module.weight, nn.Parameter)


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every ``nn.Linear`` / ``Conv1D`` of ``model`` by module name, in registration order."""
    return {n: m for n, m in model.named_modules() if n and (type(m) is nn.Linear or is_hf_conv1d(m))}


def apply_tensor_parallel(model: nn.Module, tp: TensorParallel, settings: TensorParallelConfig | Any) -> nn.Module:
    """Slice ``model`` over ``tp``'s tensor axis in place, as ``settings`` (the typed ``tensor_parallel`` section)
    plans; returns ``model``. A tensor axis of one rank, or ``autotp_size`` 0 / 1, leaves the model untouched.

    Every check runs before anything is replaced, and depends only on the model and the settings (alike on every
    rank), so a bad model fails the same way everywhere, before any collective."""
    if settings.autotp_size > 1 and settings.autotp_size != tp.size:
        raise ValueError(
            f"tensor_parallel.autotp_size is {settings.autotp_size} but the tensor axis passed has {tp.size} rank(s): "
            "build the topology with MeshShape(tensor=autotp_size)"
        )
    if tp.size == 1 or not settings.enabled:
        return model  # off (autotp_size 0 or 1): layers the script built itself are left as they are
    if bool(settings.sequence_parallel) != tp.sequence_parallel:
        raise ValueError(
            f"tensor_parallel.sequence_parallel is {settings.sequence_parallel} but the TensorParallel passed has "
            f"sequence_parallel={tp.sequence_parallel}: build it with TensorParallel.from_topology(topology, "
            "sequence_parallel=settings.sequence_parallel)"
        )
    _refuse_meta(model)
    layers = linear_layers(model)
    plan = resolve_plan(model, settings)
    assignment = plan.assign(layers, model_type_of(model))
    if settings.partition_config is not None and settings.partition_config.strict_mode:
        unmatched = [n for n in layers if n not in assignment]
        if unmatched:
            raise PlanError(
                f"tensor_parallel.partition_config.strict_mode: no rule of {plan.source} matches these linear "
                f"layers: {', '.join(unmatched)} (add a rule, partition_type 'skip' to keep one whole)"
            )
    sliced = {n: r for n, r in assignment.items() if r.style != "replicate"}
    for name, rule in sliced.items():
        if rule.style == "vocab":
            raise PlanError(f"{rule.source}: vocab-parallel slicing applies to embeddings, not linear layer '{name}'")
    check_heads_divisible(model, tp.size)
    _refuse_tied(model, {n: layers[n] for n in sliced})
    owners = _head_count_owners(model, sliced)
    sequence_plan = plan_sequence_parallel(model, list(sliced)) if settings.sequence_parallel else None
    gathered = set(sequence_plan.attention) if sequence_plan is not None else set()
    twin = attention_twin(tp) if gathered else tp
    for name, rule in sliced.items():
        in_gathered = rule.style == "column" and name.rpartition(".")[0] in gathered
        _replace(model, name, _build(layers[name], rule, twin if in_gathered else tp, name))
    for owner in owners:
        for attr in HEAD_COUNT_ATTRS:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(owner, attr, value // tp.size)
    if sequence_plan is not None:
        apply_sequence_parallel(model, tp, sequence_plan)
    return model


def check_heads_divisible(model: nn.Module, tp_size: int) -> None:
    """Attention heads and key-value heads (from the model's config) divisible by ``tp_size``, else an error."""
    config = getattr(model, "config", None)
    if config is None:
        return
    heads = _first_int(config, ("num_attention_heads", "n_head", "num_heads"))
    kv_heads = _first_int(config, ("num_key_value_heads", "n_head_kv", "num_kv_heads"))
    if kv_heads is None:
        kv_heads = heads
    bad = [f"{label} = {n}" for label, n in (("heads", heads), ("key-value heads", kv_heads)) if n and n % tp_size]
    if bad:
        raise PlanError(
            f"{type(model).__name__} ({model_type_of(model) or 'no model_type'}) has {heads} attention heads and "
            f"{kv_heads} key-value heads; tensor parallelism keeps whole heads on each rank, so both must be "
            f"divisible by the tensor-parallel size {tp_size} ({', '.join(bad)} is not)"
        )


def _first_int(obj: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def meta_refusal(model: nn.Module) -> str | None:
    """Why AutoTP cannot slice ``model`` because of meta parameters (built under zero.Init), or None. Pure: the
    caller agrees it over the world (``autotp_initialize``) so every rank raises it, not only the ranks that built
    the model under zero.Init."""
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if not meta:
        return None
    return (
        f"AutoTP needs the model's dense weights to slice, but {len(meta)} parameter(s) are on the meta device "
        f"(built under zero.Init), e.g. '{meta[0]}': build the model without zero.Init (or zero.Init(enabled=False)) "
        "and let tensor_parallel.autotp_size slice it; AutoTP under zero.Init is not supported yet"
    )


def _refuse_meta(model: nn.Module) -> None:
    refusal = meta_refusal(model)
    if refusal is not None:
        raise NotImplementedError(refusal)


def _refuse_tied(model: nn.Module, sliced: dict[str, nn.Module]) -> None:
    """A sliced weight also used by another module (tied) would be cut for one user and whole for the other."""
    users: dict[int, list[str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False):
            users.setdefault(id(param), []).append(f"{prefix}.{attr}" if prefix else attr)
    for name, module in sliced.items():
        names = sorted(set(users.get(id(module.weight), [])))
        if len(names) > 1:
            raise PlanError(
                f"cannot slice '{name}': its weight is shared (tied) with "
                f"{', '.join(n for n in names if n != name + '.weight')}; "
                "keep the layer whole (a 'skip' rule) or untie it"
            )


def _head_count_owners(model: nn.Module, sliced: dict[str, PlanRule]) -> list[nn.Module]:
    """Modules owning a column-sliced layer that hold head-count integers (attention modules)."""
    owners: dict[int, nn.Module] = {}
    for name, rule in sliced.items():
        if rule.style != "column" or rule.gather_output:
            continue
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        if any(isinstance(getattr(parent, a, None), int) for a in HEAD_COUNT_ATTRS):
            owners.setdefault(id(parent), parent)
    return list(owners.values())


def _build(dense: nn.Module, rule: PlanRule, tp: TensorParallel, name: str) -> nn.Module:
    weight = dense.weight
    layout = "in_out" if is_hf_conv1d(dense) else "out_in"
    out_features, in_features = weight.shape if layout == "out_in" else weight.shape[::-1]
    bias = dense.bias is not None
    common: dict[str, Any] = {
        "bias": bias,
        "parts": rule.parts,
        "weight_layout": layout,
        "dtype": weight.dtype,
        "device": weight.device,
    }
    split = out_features if rule.style == "column" else in_features
    if split % rule.parts:
        raise PlanError(f"{rule.source}: layer '{name}' has {split} features, not {rule.parts} equal fused parts")
    # The layer's constructor draws nn.Linear's global initialization (then overwritten by the dense slice); fork the
    # RNG so slicing leaves the user's random stream exactly where the dense model left it.
    with torch.random.fork_rng(devices=[]):
        if rule.style == "column":
            layer: nn.Module = ColumnParallelLinear(
                in_features, out_features, tp, gather_output=rule.gather_output, **common
            )
        else:
            layer = RowParallelLinear(in_features, out_features, tp, input_is_parallel=rule.input_is_parallel, **common)
    layer.load_dense(weight, dense.bias)
    layer.weight.requires_grad_(weight.requires_grad)
    if bias:
        layer.bias.requires_grad_(dense.bias.requires_grad)
    layer.train(dense.training)
    return layer


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, layer)
