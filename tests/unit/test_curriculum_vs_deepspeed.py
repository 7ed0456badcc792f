"""The legacy schedules against DeepSpeed's own ``CurriculumScheduler`` (run in the DeepSpeed venv in a subprocess,
skipped without it): every ``ROOT_CASES`` row (fixed_root and fixed_linear) and a fixed_discrete case, at every
step, both ``get_difficulty`` and the sticky ``update_difficulty`` sequence."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_curriculum_schedule import ROOT_CASES

from shardspeed.data.curriculum import CurriculumSchedule
from shardspeed.data.curriculum.schedule import sticky_difficulty

DS_PYTHON = Path("/work/dsvenv/bin/python")

DEEPSPEED_SIDE = """
import json, sys
from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
out = []
for config, steps in json.load(sys.stdin):
    s = CurriculumScheduler(config)
    out.append([[s.get_difficulty(k) for k in range(steps)], [s.update_difficulty(k) for k in range(steps)]])
print(json.dumps(out))
"""


def _cases() -> list[tuple[dict, int]]:
    cases = []
    for lo, hi, total, dstep, degree in ROOT_CASES:
        base = {"min_difficulty": lo, "max_difficulty": hi}
        params = {"total_curriculum_step": total, "difficulty_step": dstep}
        cases.append(({**base, "schedule_type": "fixed_linear", "schedule_config": params}, total + 5))
        root = {**params, "root_degree": degree}
        cases.append(({**base, "schedule_type": "fixed_root", "schedule_config": root}, total + 5))
    discrete = {"difficulty": [4, 8, 16, 12], "max_step": [3, 6, 9]}  # reaches max 16 then drops: sticky
    cases.append(
        (
            {"min_difficulty": 4, "max_difficulty": 16, "schedule_type": "fixed_discrete", "schedule_config": discrete},
            14,
        )
    )
    return cases


@pytest.mark.slow
@pytest.mark.skipif(not DS_PYTHON.exists(), reason="DeepSpeed's venv (/work/dsvenv) is not installed")
def test_schedules_equal_deepspeeds_curriculum_scheduler() -> None:
    cases = _cases()
    run = subprocess.run(
        [str(DS_PYTHON), "-c", DEEPSPEED_SIDE], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    for (config, steps), (want_get, want_update) in zip(cases, theirs, strict=True):
        p = config["schedule_config"]
        schedule = CurriculumSchedule(
            config["min_difficulty"],
            config["max_difficulty"],
            config["schedule_type"],
            p.get("total_curriculum_step"),
            p.get("difficulty_step"),
            p.get("root_degree"),
            tuple(p.get("difficulty", ())),
            tuple(p.get("max_step", ())),
        )
        assert [schedule.difficulty_at(k) for k in range(steps)] == want_get, config
        current, updates = schedule.min_difficulty, []
        for k in range(steps):
            current = sticky_difficulty(schedule, current, k, None)
            updates.append(current)
        assert updates == want_update, config
