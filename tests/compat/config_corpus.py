"""The config corpus: DeepSpeed configs written from DeepSpeed's documented keys (tutorials, the config-json page,
DeepSpeedExamples, DeepSpeed-Chat), each with the outcome expected in shardspeed (``configs/expected.json``).

``python tests/compat/config_corpus.py`` prints the markdown table (config -> outcome -> reason) used in the notes.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "configs"


@dataclass(frozen=True)
class Outcome:
    status: str
    """"loads" or "refused"."""
    reason: str
    """loads: the warnings, joined; refused: the ConfigError's message."""
    warnings: tuple[str, ...] = ()


def expected() -> dict[str, dict]:
    """name -> {"source", "world", "outcome", "reason"} as recorded by hand in configs/expected.json."""
    return json.loads((CONFIGS / "expected.json").read_text())


def load_outcome(name: str, world: int) -> Outcome:
    from shardspeed.config import ConfigError, load_config

    try:
        config = load_config(CONFIGS / f"{name}.json", dp_world_size=world)
    except ConfigError as error:
        return Outcome("refused", str(error))
    return Outcome("loads", "; ".join(config.warnings), tuple(config.warnings))


def markdown() -> str:
    lines = ["| config | written from | outcome | reason |", "|---|---|---|---|"]
    for name, entry in expected().items():
        got = load_outcome(name, entry.get("world", 1))
        reason = entry["reason"]
        if got.status == "loads" and got.warnings:
            reason = f"{len(got.warnings)} warning(s): {reason}"
        lines.append(f"| `{name}.json` | {entry['source']} | {got.status} | {reason.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1] / "src"))
    print(markdown(), end="")
