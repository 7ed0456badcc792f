"""Ready plans for Hugging Face models, and which plan a model gets (``resolve_plan``).

Presets (``preset_model``; also chosen from ``config.model_type`` when nothing else is given):
- **gpt2**: ``attn.c_attn`` is one ``Conv1D`` holding q, k and v side by side (``[in, 3·hidden]``), so it is
  column-parallel with 3 fused parts (each rank keeps its heads of q, of k and of v); ``attn.c_proj`` row;
  ``mlp.c_fc`` column; ``mlp.c_proj`` row. Embeddings and the (tied) LM head stay replicated.
- **llama** / **mistral** / **qwen2**: ``q/k/v_proj``, ``gate/up_proj`` column; ``o_proj``, ``down_proj`` row.

Which plan (DeepSpeed's ``resolve_tp_config`` order, plus one step): ``partition_config.layer_specs`` when given
(followed by the preset's rules when ``preset_model`` is set and ``use_default_specs``), else the model's own
Hugging Face ``tp_plan`` (``base_model_tp_plan``) when non-empty, else ``preset_model``, else the preset named by
``config.model_type`` — DeepSpeed raises there; GPT-2 has no HF plan and would be unusable without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardspeed.tensor_parallel.plan import Plan, PlanError, PlanRule, plan_from_hf_tp_plan, plan_from_layer_specs

if TYPE_CHECKING:
    from torch import nn

    from shardspeed.config.tensor_parallel import TensorParallelConfig


def _gpt2() -> Plan:
    src = "preset gpt2"
    return Plan(
        (
            PlanRule(r".*\.attn\.c_attn$", "column", parts=3, source=src),
            PlanRule(r".*\.attn\.c_proj$", "row", source=src),
            PlanRule(r".*\.mlp\.c_fc$", "column", source=src),
            PlanRule(r".*\.mlp\.c_proj$", "row", source=src),
        ),
        src,
    )


def _llama_like(name: str) -> Plan:
    src = f"preset {name}"
    return Plan(
        (
            PlanRule(r".*\.self_attn\.[qkv]_proj$", "column", source=src),
            PlanRule(r".*\.self_attn\.o_proj$", "row", source=src),
            PlanRule(r".*\.mlp\.(gate|up)_proj$", "column", source=src),
            PlanRule(r".*\.mlp\.down_proj$", "row", source=src),
        ),
        src,
    )


PRESETS: Mapping[str, Plan] = {
    "gpt2": _gpt2(),
    "llama": _llama_like("llama"),
    "mistral": _llama_like("mistral"),
    "qwen2": _llama_like("qwen2"),
}


def model_type_of(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    return model_type.lower() if isinstance(model_type, str) else None


def hf_tp_plan_of(model: nn.Module) -> dict[str, str]:
    """The model's Hugging Face tensor-parallel plan, keys relative to ``model`` (empty when it has none)."""
    plan = getattr(model, "_tp_plan", None)
    if isinstance(plan, Mapping) and plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if isinstance(base, Mapping) and base:
        prefix = getattr(model, "base_model_prefix", "")
        under_prefix = bool(prefix) and hasattr(model, prefix)
        return {(f"{prefix}.{k}" if under_prefix else k): v for k, v in base.items()}
    return {}


def resolve_plan(model: nn.Module, settings: TensorParallelConfig | Any) -> Plan:
    """The plan ``model`` gets under ``settings`` (the typed ``tensor_parallel`` section); see the module doc."""
    preset = PRESETS[settings.preset_model] if settings.preset_model is not None else None
    specs = settings.layer_specs
    if specs:
        custom = plan_from_layer_specs(specs)
        use_defaults = settings.partition_config is not None and settings.partition_config.use_default_specs
        return custom.then(preset) if preset is not None and use_defaults else custom
    hf_plan = hf_tp_plan_of(model)
    if hf_plan:
        return plan_from_hf_tp_plan(hf_plan)
    if preset is not None:
        return preset
    model_type = model_type_of(model)
    if model_type in PRESETS:
        return PRESETS[model_type]
    raise PlanError(
        f"no tensor-parallel plan for {type(model).__name__} (model_type {model_type!r}): give "
        "tensor_parallel.partition_config.layer_specs, a model with a Hugging Face base_model_tp_plan, or "
        f"tensor_parallel.preset_model (one of {', '.join(PRESETS)})"
    )
