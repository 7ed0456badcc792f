"""The table of every DeepSpeed 0.19 config key and what shardspeed does with it: implemented, ignored, or refused.

Nothing here is declared twice: the rows are assembled from the sources the loader itself reads —
- the typed sections (``ShardSpeedConfig`` and its nested models) and their ``KEY_ALIASES``;
- ``effects.FIELD_EFFECTS`` for each typed field: ``acts`` -> implemented, ``warns`` -> ignored (one warning when
  set), ``refused`` -> refused (a ConfigError naming the feature when set);
- ``keys.IGNORED_KEYS`` / ``keys.UNSUPPORTED_KEYS`` for DeepSpeed keys with no typed field, and
  ``keys.SECTION_KEYS`` for the keys inside those sections (they share their section's status).
So the table cannot drift from what ``load_config`` does. tests/unit/test_config_key_table.py compares its paths
with the inventory of DeepSpeed's keys (tests/compat/deepspeed_config_keys.json) and checks that the rendered copy
in docs/deepspeed_config_keys.md is current; ``python -m shardspeed.config.key_table`` prints it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from .base import ConfigModel
from .effects import FIELD_EFFECTS
from .keys import IGNORED_KEYS, SECTION_KEYS, UNSUPPORTED_KEYS
from .normalize import _section_model
from .root import ShardSpeedConfig

Status = Literal["implemented", "ignored", "refused"]

_STATUS_OF_EFFECT: dict[str, Status] = {"acts": "implemented", "warns": "ignored", "refused": "refused"}

SHARDSPEED_ONLY_KEYS: frozenset[str] = frozenset(
    {"seed", "fault_tolerance", "tensor_parallel.sequence_parallel", "pipeline.schedule", "pipeline.zero_hold"}
    | {"zero_optimization.overlap_param_gather", "communication"}
    | {"zero_optimization.offload_optimizer.offload_gradients"}
    | {f"communication.{k}" for k in ("collectives", "calibration_cache")}
    | {f"autotuning.{k}" for k in ("device_memory_gb", "host_memory_gb", "progress_path", "trial_timeout_s")}
    | {
        f"fault_tolerance.{k}"
        for k in (
            "propagate_failures",
            "watch_interval_s",
            "collective_timeout_s",
            "verify_collective_order",
            "skip_nonfinite_steps",
            "max_consecutive_nonfinite",
            "min_loss_scale_patience",
            "checkpoint_dir",
            "save_on_preemption",
            "auto_resume",
            "preemption_signals",
        )
    }
)
"""Typed keys that are shardspeed's own, not DeepSpeed's (listed in the table, absent from DeepSpeed's inventory)."""


@dataclass(frozen=True)
class KeyRow:
    path: str
    """Full dotted path, as a DeepSpeed config spells it."""
    status: Status
    detail: str
    """implemented: what reads it; ignored / refused: the DeepSpeed feature shardspeed lacks."""
    alias_of: str | None = None
    """Another spelling of this canonical path (``bfloat16`` -> ``bf16``)."""


def key_table() -> list[KeyRow]:
    """Every DeepSpeed key shardspeed knows, sorted by path."""
    rows = list(_typed_rows(ShardSpeedConfig, ""))
    for table, status in ((IGNORED_KEYS, "ignored"), (UNSUPPORTED_KEYS, "refused")):
        for path, rule in table.items():
            rows.append(KeyRow(path, status, rule.feature))  # type: ignore[arg-type]
            rows.extend(KeyRow(child, status, rule.feature) for child in _section_children(path))  # type: ignore[arg-type]
    return sorted(rows, key=lambda row: row.path)


def _typed_rows(model: type[ConfigModel], prefix: str) -> Iterator[KeyRow]:
    for name, info in model.model_fields.items():
        if name in model.INTERNAL_FIELDS:
            continue
        path = f"{prefix}.{name}" if prefix else name
        section, _ = _section_model(info.annotation)
        if section is not None:
            yield KeyRow(path, "implemented", "section")
            yield from _typed_rows(section, path)
        else:
            effect = FIELD_EFFECTS[path]
            detail = "shardspeed's own key: " + effect.why if path in SHARDSPEED_ONLY_KEYS else effect.why
            yield KeyRow(path, _STATUS_OF_EFFECT[effect.kind], detail)
    for alias, canonical in model.KEY_ALIASES.items():
        target = f"{prefix}.{canonical}" if prefix else canonical
        status: Status = _STATUS_OF_EFFECT[FIELD_EFFECTS[target].kind] if target in FIELD_EFFECTS else "implemented"
        yield KeyRow(f"{prefix}.{alias}" if prefix else alias, status, f"alias of {target}", alias_of=target)


def _section_children(path: str) -> Iterator[str]:
    for child in SECTION_KEYS.get(path, ()):
        child_path = f"{path}.{child}"
        yield child_path
        yield from _section_children(child_path)


def render_markdown() -> str:
    """The table as markdown (docs/deepspeed_config_keys.md)."""
    rows = key_table()
    counts = {status: sum(row.status == status for row in rows) for status in ("implemented", "ignored", "refused")}
    lines = [
        "# DeepSpeed 0.19 config keys in shardspeed",
        "",
        "Generated by `python -m shardspeed.config.key_table` from the loader's own tables (`config/effects.py`,",
        "`config/keys.py`, the typed sections); tests/unit/test_config_key_table.py fails when this file is stale.",
        "",
        "- **implemented**: read and acted on.",
        "- **ignored**: accepted; set to a value that turns it on, one warning says it has no effect here (monitors,",
        "  profilers, performance-only switches: nothing that changes what training computes).",
        "- **refused**: set to a value that turns it on, a ConfigError names the missing feature (left at its",
        "  default or switched off, it is accepted in silence, as DeepSpeed would ignore it too).",
        "- Any other key: an error naming the nearest known key when it is within 2 edits of one (a misspelling),",
        "  else one warning.",
        "",
        f"{len(rows)} keys: {counts['implemented']} implemented, {counts['ignored']} ignored, "
        f"{counts['refused']} refused.",
        "",
        "| key | status | what reads it / the missing feature |",
        "|---|---|---|",
    ]
    lines += [f"| `{row.path}` | {row.status} | {row.detail.replace('|', '/')} |" for row in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
