"""The fault table of issue #13: every fault run as a real launched 2-rank job, one Markdown row each.

    python benchmarks/fault_table.py [--rows NAME,...] [--out TABLE.md] [--timeout S] [--workdir DIR] [--list]

Each row writes a spec (``ROW/spec.json``) for ``fault_table_script.py`` and launches it with the shardspeed
launcher (``python -m shardspeed.launcher.cli --num_procs 2 --enable_each_rank_log ...``), then reports:

- **what every rank printed**: the last error-looking line of each rank's own log (else its last line), so the
  row shows whether each rank named the failing rank; and the launcher's exit code;
- **time to exit**: from the fault (the wall-clock time the injecting rank wrote into ``fault.json`` just before
  injecting; for SIGTERM, when the harness sent it) to the last process of the launch exiting. A launch still
  running after ``--timeout`` seconds is killed, the launcher and everything below it, and the row says
  ``TIMEOUT (hang)``: that is a finding, not a harness failure. Processes that outlive the launcher are counted
  as orphans (the harness is their subreaper, so they cannot escape to init) and killed;
- **on disk afterwards**: the checkpoint directory's ``latest``, committed tags, leftover ``.tmp-*`` / ``.old-*``
  directories, and whether the latest checkpoint loads in a fresh single-process run (``--verify``);
- **resume**: where it applies, a second launch resumes (``--resume`` = ``load_checkpoint(latest)``, or the
  config's ``auto_resume`` for the preemption row) and runs to the end; its final parameters are compared with an
  uninterrupted run of the same config (max abs difference; equal means <= 1e-6).

Uninterrupted baselines are run once per distinct (stage, precision, config, steps). Rows whose behaviour is
built on other branches show today's behaviour until those are merged (hangs, "stepping anyway").
The work directory (logs, checkpoints, specs) is kept; its path is printed.

Modules: ``fault_rows.py`` (the rows, their specs, the checkpoint damage), ``fault_procs.py`` (one launch, its
timeout and orphans, the single-process load check), ``fault_report.py`` (reading logs and the checkpoint
directory, the Markdown), ``fault_table_script.py`` (what every rank runs); this file runs rows and resumes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from fault_procs import NPROC, Launch, become_subreaper, launch, verify_latest
from fault_report import (
    RowResult,
    describe_checkpoints,
    describe_exit,
    describe_verify,
    last_error_line,
    launcher_summary,
    max_abs_diff,
    rank_exit_codes,
    render_table,
    time_to_exit,
)
from fault_rows import DAMAGE, ROWS, Row, baseline_key, make_spec, rank_file, select_rows

DEFAULT_TIMEOUT_S = 180.0
EQUAL_TOLERANCE = 1e-6

# ---------------------------------------------------------------------------------------------- the runner


class TableRunner:
    """Runs rows (and the baselines they need) under one work directory."""

    def __init__(self, workdir: Path, timeout_s: float, log: Callable[[str], None] = print) -> None:
        self.workdir = workdir
        self.timeout_s = timeout_s
        self.log = log
        self.baselines: dict[str, Path] = {}

    def baseline(self, row: Row) -> Path | None:
        """The uninterrupted run's directory for ``row``'s numerics (run once); None if it failed."""
        key = baseline_key(row)
        if key not in self.baselines:
            base_dir = self.workdir / f"baseline-{hashlib.sha1(key.encode()).hexdigest()[:8]}"
            base_dir.mkdir(parents=True, exist_ok=True)
            spec_path = base_dir / "spec.json"
            config = {k: v for k, v in row.config.items() if k != "fault_tolerance"}
            plain = replace(row, config=config, save_every=2)  # the damage rows copy its checkpoints
            spec_text = json.dumps(make_spec(plain, base_dir, fault=False), indent=1)
            # A finished baseline of the same spec in a reused --workdir is kept (reruns of a few rows).
            if not (
                spec_path.exists() and spec_path.read_text() == spec_text and (base_dir / "run/done.json").exists()
            ):
                spec_path.write_text(spec_text)
                self.log(f"[fault_table] baseline for {row.name}: {base_dir}")
                job = launch(spec_path, base_dir / "run", resume=False, timeout_s=self.timeout_s)
                if job.exit_code != 0 or not (base_dir / "run" / "final.pt").exists():
                    self.log(f"[fault_table] baseline FAILED ({describe_exit(job)}); see {base_dir}")
            self.baselines[key] = base_dir
        base_dir = self.baselines[key]
        return base_dir if (base_dir / "run" / "final.pt").exists() else None

    def run_row(self, row: Row) -> RowResult:
        row_dir = self.workdir / row.name
        if row_dir.exists():
            shutil.rmtree(row_dir)
        row_dir.mkdir(parents=True)
        notes: list[str] = []
        spec_path = row_dir / "spec.json"
        spec_path.write_text(json.dumps(make_spec(row, row_dir, fault=True), indent=1))
        base = self.baseline(row) if (row.resume or row.damage or row.fault is not None) else None
        if row.damage:
            if base is None:
                return self._harness_failure(row, "the baseline run failed, nothing to damage")
            shutil.copytree(base / "ckpt", row_dir / "ckpt")
            tag = (row_dir / "ckpt" / "latest").read_text().strip()
            notes.append(DAMAGE[row.damage](rank_file(row_dir / "ckpt" / tag, 1)) + f" (tag {tag})")
        self.log(f"[fault_table] {row.name}: launching ({row_dir})")
        job = launch(
            spec_path,
            row_dir / "run",
            resume=row.damage is not None,
            timeout_s=self.timeout_s,
            sigterm_on_marker=row.sigterm_launcher,
        )
        fault_time = job.sigterm_sent if row.sigterm_launcher else _fault_time(row_dir / "run")
        printed = {rank: last_error_line(job.rank_logs.get(rank, "")) for rank in range(NPROC)}
        for rank, code in rank_exit_codes(job.launcher_stderr).items():
            printed[rank] = f"[{code}] {printed.get(rank, '')}"
        launcher = describe_exit(job)
        launcher_line = launcher_summary(job.launcher_stderr)
        if launcher_line:
            launcher += f": {launcher_line}"
        on_disk = describe_checkpoints(row_dir / "ckpt")
        on_disk += "; " + describe_verify(verify_latest(spec_path, row_dir / "ckpt"))
        nvme = row_dir / "nvme"
        if nvme.is_dir():
            on_disk += f"; nvme dir: {sum(1 for _ in nvme.rglob('*') if _.is_file())} file(s)"
        resume = self._resume(row, row_dir, base, job)
        return RowResult(
            row.name,
            row.title,
            printed,
            launcher,
            time_to_exit(job, fault_time, self.timeout_s),
            on_disk,
            resume,
            notes,
        )

    def _resume(self, row: Row, row_dir: Path, base: Path | None, job: Launch) -> str:
        final = row_dir / "run" / "final.pt"
        if not row.resume:
            if final.exists() and base is not None:
                done = json.loads((row_dir / "run" / "done.json").read_text())
                diff = max_abs_diff(final, base / "run" / "final.pt")
                finite = "finite" if done.get("finite") else "NOT finite"
                return (
                    f"n/a; run finished: params {finite}, skipped steps {done.get('skipped_steps')}, "
                    f"max abs diff vs uninterrupted {diff:.2e}"
                )
            return "n/a"
        if base is None:
            return "no baseline (uninterrupted run failed)"
        if job.exit_code == 0 and final.exists():
            diff = max_abs_diff(final, base / "run" / "final.pt")
            return f"not needed: the job finished (exit 0); max abs diff vs uninterrupted {diff:.2e}"
        auto = row.sigterm_launcher
        spec_path = row_dir / "spec-resume.json"
        spec_path.write_text(json.dumps(make_spec(row, row_dir, fault=False, auto_resume=auto), indent=1))
        self.log(f"[fault_table] {row.name}: resuming")
        again = launch(spec_path, row_dir / "resume", resume=not auto, timeout_s=self.timeout_s)
        how = "auto_resume" if auto else "load_checkpoint(latest)"
        if again.exit_code != 0 or not (row_dir / "resume" / "final.pt").exists():
            lines = "; ".join(f"r{r}: {last_error_line(t)}" for r, t in sorted(again.rank_logs.items()))
            return f"resume ({how}) failed: {describe_exit(again)}; {lines}"
        start = json.loads((row_dir / "resume" / "start.json").read_text())["start_step"]
        diff = max_abs_diff(row_dir / "resume" / "final.pt", base / "run" / "final.pt")
        if not start:  # a full rerun: equal parameters would prove nothing about resuming
            return f"NOT resumed ({how}: restarted from step 0); max abs diff vs uninterrupted {diff:.2e}"
        verdict = "reproduced" if diff <= EQUAL_TOLERANCE else "DIFFERS"
        return f"{verdict} ({how}, resumed at step {start}): max abs diff {diff:.2e}"

    def _harness_failure(self, row: Row, why: str) -> RowResult:
        return RowResult(row.name, row.title, {}, "not run", "-", "-", "-", [f"harness: {why}"])


def _fault_time(run_dir: Path) -> float | None:
    marker = run_dir / "fault.json"
    return json.loads(marker.read_text())["time"] if marker.exists() else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row names (default: all; --list shows them)")
    parser.add_argument("--out", help="write the Markdown table here (it is printed either way)")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per launch (default %(default)s)"
    )
    parser.add_argument("--workdir", help="where rows keep logs and checkpoints (default: a new temporary dir, kept)")
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    args = parser.parse_args(argv)
    if args.list:
        for row in ROWS:
            print(f"{row.name:<22} {row.title}")
        return 0
    rows = select_rows(args.rows)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fault-table-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if not become_subreaper():
        print("[fault_table] not Linux: orphans cannot be tracked", file=sys.stderr)
    runner = TableRunner(workdir, args.timeout, log=lambda line: print(line, file=sys.stderr, flush=True))
    results = []
    started = time.monotonic()
    for row in rows:
        results.append(runner.run_row(row))
        print(render_table(results[-1:]).splitlines()[2], file=sys.stderr, flush=True)
    table = render_table(results)
    footer = f"\n{len(rows)} row(s) in {time.monotonic() - started:.0f} s; work directory: {workdir}\n"
    if args.out:
        Path(args.out).write_text(table)
    print(table + footer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
