"""Declarative tensor-parallel plans: an ordered list of (layer-name pattern → style), pure (no torch, no ranks).

A plan says *what* to slice; ``autotp.py`` does it. Three sources build one (``hf_plans.py`` chooses between them):
- DeepSpeed's ``partition_config.layer_specs`` (regexes ``re.match``-ed against the weight name *or* the module
  name, as DeepSpeed's examples use both; ``partition_type`` column / row / skip; ``shape`` [k, -1] = k fused
  blocks) — ``plan_from_layer_specs``;
- a Hugging Face model's ``tp_plan`` / ``base_model_tp_plan`` (module names with ``*`` for a layer index; styles
  "colwise", "rowwise", "colwise_rep", "rowwise_rep", "replicate") — ``plan_from_hf_tp_plan``;
- shardspeed's presets (``hf_plans.PRESETS``).

[Note: plan matching] The first rule whose pattern matches a layer decides its style (DeepSpeed's rule); a layer no
rule matches stays whole (replicated). A rule whose pattern matches no layer at all is an error naming it — a
misspelt pattern would otherwise leave the model silently unsliced. Rules from a Hugging Face plan are exempt one
by one (transformers 4.57 attaches each base-model key twice, once relative to the base model and once under its
prefix, so one of the two never matches); such a plan must still match some layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from shardspeed.config.tensor_parallel import LayerSpecConfig

Style = Literal["column", "row", "vocab", "replicate"]

HF_STYLES: Mapping[str, tuple[Style, dict[str, bool]]] = {
    "colwise": ("column", {}),
    "rowwise": ("row", {}),
    # Output replicated: the column layer all-gathers its output (an untied LM head).
    "colwise_rep": ("column", {"gather_output": True}),
    # Input replicated: the row layer takes its own slice of the input first.
    "rowwise_rep": ("row", {"input_is_parallel": False}),
    "replicate": ("replicate", {}),
}
"""Hugging Face parallel styles (transformers 4.57's ``ALL_PARALLEL_STYLES``) that map onto shardspeed's layers."""

HF_STYLES_REFUSED: Mapping[str, str] = {
    "local_colwise": "local (non-DTensor) shards that a later 'gather' module reassembles",
    "local_rowwise": "local (non-DTensor) shards that a later 'gather' module reassembles",
    "local": "isolated modules (each rank its own copy, e.g. experts)",
    "gather": "gathering local shards at a module boundary",
    "local_packed_rowwise": "packed local row shards",
    "sequence_parallel": "HF's sequence-parallel norms (use tensor_parallel.sequence_parallel instead)",
    "grouped_gemm": "grouped expert GEMMs",
    "ep_router": "expert-parallel routers",
}


class PlanError(ValueError):
    """A plan that cannot be built or applied; the message names the culprit."""


@dataclass(frozen=True)
class PlanRule:
    """One rule: layers whose name matches ``pattern`` are sliced in ``style``."""

    pattern: str
    """A regular expression, ``re.match``-ed against the module name and the module name + ``.weight``."""
    style: Style
    parts: int = 1
    """Fused equal blocks along the split dim (GPT-2's ``c_attn`` QKV: 3), each split separately."""
    gather_output: bool = False
    """column: all-gather the output (every tensor rank gets all features)."""
    input_is_parallel: bool = True
    """row: the input arrives split along its last dim (from a column layer); false: replicated, sliced here."""
    model_types: tuple[str, ...] | None = None
    """Applies only when the model's ``config.model_type`` is one of these (lower case)."""
    source: str = ""
    """Where the rule came from, for messages ("partition_config.layer_specs[2]", "preset llama", ...)."""
    required: bool = True
    """Matching no layer is an error ([Note: plan matching])."""

    def __post_init__(self) -> None:
        if self.style not in ("column", "row", "vocab", "replicate"):
            raise PlanError(f"{self.source or 'plan rule'}: unknown style {self.style!r}")
        if self.parts < 1:
            raise PlanError(f"{self.source or 'plan rule'}: parts must be >= 1, got {self.parts}")
        if self.gather_output and (self.style != "column" or self.parts > 1):
            raise PlanError(f"{self.source or 'plan rule'}: gather_output needs a column rule without fused parts")
        try:
            re.compile(self.pattern)
        except re.error as error:
            where = self.source or "plan rule"
            raise PlanError(f"{where}: {self.pattern!r} is not a regular expression: {error}") from None

    def applies_to(self, model_type: str | None) -> bool:
        return self.model_types is None or (model_type is not None and model_type.lower() in self.model_types)

    def matches(self, layer_name: str) -> bool:
        return bool(re.match(self.pattern, layer_name) or re.match(self.pattern, f"{layer_name}.weight"))


@dataclass(frozen=True)
class Plan:
    """Ordered rules; ``source`` names the plan in messages."""

    rules: tuple[PlanRule, ...]
    source: str

    def assign(self, layer_names: Iterable[str], model_type: str | None = None) -> dict[str, PlanRule]:
        """Layer name → the first rule matching it (replicate rules included); unmatched layers are absent.

        Raises ``PlanError`` naming every required rule that matches none of ``layer_names``."""
        names = list(layer_names)
        rules = [r for r in self.rules if r.applies_to(model_type)]
        matched: dict[str, PlanRule] = {}
        for name in names:
            for rule in rules:
                if rule.matches(name):
                    matched[name] = rule
                    break
        idle = [r for r in rules if r.required and not any(r.matches(n) for n in names)]
        if idle:
            listed = "; ".join(f"{r.pattern!r} ({r.source})" for r in idle)
            raise PlanError(
                f"tensor-parallel plan ({self.source}): pattern(s) matching no linear layer of the model: {listed}. "
                f"The model's linear layers are: {_sample(names)}"
            )
        if rules and not matched:
            raise PlanError(
                f"tensor-parallel plan ({self.source}) matches none of the model's linear layers: {_sample(names)}"
            )
        return matched

    def then(self, other: Plan) -> Plan:
        """This plan's rules first, ``other``'s after (a custom plan over a preset: DeepSpeed's merge order)."""
        return Plan(self.rules + other.rules, f"{self.source}, then {other.source}")


def _sample(names: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "") if names else "(none)"


def plan_from_layer_specs(specs: Sequence[LayerSpecConfig], source: str = "partition_config.layer_specs") -> Plan:
    """DeepSpeed's ``layer_specs`` (typed by config/tensor_parallel.py) as a plan."""
    rules: list[PlanRule] = []
    for index, spec in enumerate(specs):
        style: Style = "replicate" if spec.partition_type == "skip" else spec.partition_type
        model_types = tuple(t.lower() for t in spec.model_types) if spec.model_types is not None else None
        for pattern in spec.patterns:
            rules.append(
                PlanRule(
                    pattern,
                    style,
                    parts=spec.fused_parts() if style != "replicate" else 1,
                    gather_output=spec.gather_output,
                    model_types=model_types,
                    source=f"{source}[{index}]",
                )
            )
    return Plan(tuple(rules), source)


def hf_glob_to_regex(key: str) -> str:
    """A Hugging Face plan key (``model.layers.*.self_attn.q_proj``: ``*`` is one name component, a layer index)
    as an anchored regex over module names."""
    return "^" + r"\.".join(r"[^.]+" if part == "*" else re.escape(part) for part in key.split(".")) + "$"


def plan_from_hf_tp_plan(tp_plan: Mapping[str, str], source: str = "the model's Hugging Face tp_plan") -> Plan:
    """A Hugging Face ``tp_plan`` as a plan; styles with no shardspeed equivalent are an error naming them."""
    rules: list[PlanRule] = []
    refused: list[str] = []
    for key, style_name in tp_plan.items():
        name = str(style_name)
        if name in HF_STYLES:
            style, extra = HF_STYLES[name]
            rules.append(PlanRule(hf_glob_to_regex(key), style, source=f"{source}: {key!r}", required=False, **extra))
        elif name in HF_STYLES_REFUSED:
            refused.append(f"{key!r}: {name!r} ({HF_STYLES_REFUSED[name]})")
        else:
            refused.append(f"{key!r}: {name!r} (unknown style)")
    if refused:
        raise PlanError(
            f"{source} uses parallel styles shardspeed does not support: {'; '.join(refused)}. Supported: "
            f"{', '.join(HF_STYLES)}; or give tensor_parallel.partition_config.layer_specs"
        )
    return Plan(tuple(rules), source)
