"""Reading a run directory back: the monitors' scalars (CSV, else TensorBoard), the config, the profiler output.

The CSV layout is DeepSpeed's csv_monitor (what shardspeed's monitor writes too): one file per tag,
``{output_path}/{job_name}/{tag with '/' and ' ' → '_'}.csv``, a header row ``step,<last component of the tag>``
and rows ``x,value``. The file name loses the ``/``s; the header keeps the last component, so the tag is rebuilt
as ``<the stem before it, '_' → '/'>/<header>`` — exact for every tag shardspeed writes (``Train/Samples/lr``,
``Memory/rank3/host_peak_bytes``), whose leading components hold no ``_``. A file appended to by a restarted run
repeats its header row; rows that are not two numbers are skipped, and where a rerun or a resume logged the same
x twice the last value wins (``_merge``), so the line does not zig-zag between two runs. Only files whose first
row is ``step,<name>`` are the monitor's: any other CSV under the run (a user's ``eval_results.csv``) is ignored,
and when none qualifies the TensorBoard files are read instead.

TensorBoard event files (``events.out.tfevents.*``) are read with tensorboard's own ``EventAccumulator``, never
parsed by hand; tensorboard is imported only when there are no monitor CSV files.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

Series = list[tuple[int, float]]
"""(x = global samples, value), sorted by x."""

CONFIG_NAME = "ds_config.json"
PROFILE_NAME = "flops_profile.txt"


@dataclass
class RunData:
    """What a run directory holds, as the report needs it."""

    scalars: dict[str, Series] = field(default_factory=dict)
    source: str = "none"
    """``"csv"``, ``"tensorboard"`` or ``"none"``: where ``scalars`` came from."""
    source_files: list[Path] = field(default_factory=list)
    config_path: Path | None = None
    profile_path: Path | None = None


def tag_from_csv(stem: str, header: str) -> str:
    """The monitor tag a CSV file holds, from its file stem and its header's value column."""
    if header and stem.endswith("_" + header) and len(stem) > len(header) + 1:
        return stem[: -len(header) - 1].replace("_", "/") + "/" + header
    return stem


def read_csv_scalars(path: Path) -> tuple[str, Series]:
    """One csv_monitor file: its tag and its points (non-numeric rows, e.g. a repeated header, skipped)."""
    header, points = "", []
    with path.open(newline="") as handle:
        for row in csv.reader(handle):
            if len(row) != 2:
                continue
            try:
                points.append((int(float(row[0])), float(row[1])))
            except ValueError:
                header = header or row[1]
    return tag_from_csv(path.stem, header), points


def read_tensorboard_scalars(directory: Path) -> dict[str, Series]:
    """Every scalar tag of the event files in ``directory`` (tensorboard's ``EventAccumulator``; all points)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
    except ImportError as error:
        raise RuntimeError(
            f"reading the TensorBoard event files in {str(directory)!r} needs tensorboard, which is not installed: "
            "pip install 'shardspeed[monitor]' (or log with csv_monitor, which the report reads without it)"
        ) from error

    accumulator = EventAccumulator(str(directory), size_guidance={SCALARS: 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()[SCALARS]}


def _merge(into: dict[str, Series], tag: str, points: Series) -> None:
    """Add ``points`` to ``tag``'s series; on a repeated x the later point wins (files are read in order, and
    within a file a resumed run's rows come after the earlier run's)."""
    by_x = dict(into.get(tag, []))
    by_x.update(points)
    into[tag] = sorted(by_x.items())


def is_monitor_csv(path: Path) -> bool:
    """Whether ``path``'s first row is csv_monitor's header ``step,<name>``."""
    try:
        with path.open(newline="") as handle:
            first = next(csv.reader(handle), [])
    except (OSError, UnicodeDecodeError):
        return False
    return len(first) == 2 and first[0] == "step" and bool(first[1])


def _under(run_dir: Path, pattern: str) -> list[Path]:
    """Files matching ``pattern`` anywhere under ``run_dir``, shallowest first. The report writes only
    ``index.html`` and ``*.png``, which no pattern here matches, so an ``--out`` inside (or above) the run dir hides
    nothing."""
    found = [p for p in run_dir.rglob(pattern) if p.is_file()]
    return sorted(found, key=lambda p: (len(p.relative_to(run_dir).parts), str(p)))


def read_run(run_dir: Path) -> RunData:
    """Scalars, config and profiler output found anywhere under ``run_dir``."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    data = RunData()
    configs, profiles = _under(run_dir, CONFIG_NAME), _under(run_dir, PROFILE_NAME)
    data.config_path = configs[0] if configs else None
    data.profile_path = profiles[0] if profiles else None
    csv_files = [p for p in _under(run_dir, "*.csv") if is_monitor_csv(p)]
    if csv_files:
        data.source, data.source_files = "csv", csv_files
        for path in csv_files:
            tag, points = read_csv_scalars(path)
            _merge(data.scalars, tag, points)
        return data
    event_dirs = sorted({p.parent for p in _under(run_dir, "events.out.tfevents.*")})
    if event_dirs:
        data.source, data.source_files = "tensorboard", event_dirs
        for directory in event_dirs:
            for tag, points in read_tensorboard_scalars(directory).items():
                _merge(data.scalars, tag, points)
    return data
