"""Every config of the corpus (tests/compat/configs: DeepSpeed configs written from DeepSpeed's documented keys) loads,
or is refused with an error naming the feature shardspeed lacks, as recorded in configs/expected.json."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from config_corpus import CONFIGS, expected, load_outcome, markdown

EXPECTED = expected()


def test_every_config_has_an_expected_outcome() -> None:
    files = sorted(p.stem for p in CONFIGS.glob("*.json") if p.name != "expected.json")
    assert files == sorted(EXPECTED)
    assert len(files) >= 30
    for name in files:  # each is a JSON object a DeepSpeed config could be
        assert isinstance(json.loads((CONFIGS / f"{name}.json").read_text()), dict)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_or_is_refused_naming_the_feature(name: str) -> None:
    entry = EXPECTED[name]
    got = load_outcome(name, entry["world"])
    assert got.status == entry["outcome"], got.reason
    if got.status == "refused":
        # the feature is named, and the message says it is missing (not that the config is malformed)
        assert entry["reason"] in got.reason and re.search(r"not support(ed)? yet", got.reason), got.reason
    else:
        assert len(got.warnings) == entry["warnings"], got.warnings


def test_corpus_table_renders_one_row_per_config() -> None:
    rows = markdown().splitlines()[2:]
    assert len(rows) == len(EXPECTED)
    assert sum("| refused |" in row for row in rows) == sum(e["outcome"] == "refused" for e in EXPECTED.values())
