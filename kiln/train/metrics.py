"""Run metrics: metrics.jsonl (one JSON object per logged step or eval), a rich progress bar with
ETA, and the same scalars sent to the experiment trackers of `train.report_to` (kiln.train.trackers).

On resume the log is cut back to the checkpoint's step, so a killed-and-resumed run ends with
exactly the lines an uninterrupted one writes. A line that is no record (not JSON, no numeric step)
never costs the valid records after it: it is named and kept aside in metrics.rejected.jsonl.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from kiln.hub.files import write_text_atomic
from kiln.train.trackers import open_trackers, scalars

REJECTED = "metrics.rejected.jsonl"


def _record(line: str) -> dict[str, Any] | None:
    """A metrics record (a JSON object with a numeric step), or None."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError:
        return None
    step = value.get("step") if isinstance(value, dict) else None
    return value if isinstance(step, (int, float)) and not isinstance(step, bool) else None


def split_metrics(path: str | os.PathLike) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """(records, bad lines as (line number, text)) of a metrics.jsonl. A torn last line (no newline: the
    writer was killed mid-line) is dropped, as the run that wrote it never finished that record."""
    path = Path(path)
    if not path.is_file():
        return [], []
    records: list[dict[str, Any]] = []
    bad: list[tuple[int, str]] = []
    raw = path.read_bytes().decode("utf-8", errors="replace")
    lines = raw.split("\n")
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _record(line)
        if record is not None:
            records.append(record)
        elif no < len(lines):  # the last piece after the final newline is a torn tail
            bad.append((no, line))
    return records, bad


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, past any line that is no record; a torn last line is dropped."""
    return split_metrics(path)[0]


class MetricsLog:
    """Appends records to RUN_DIR/metrics.jsonl (rank 0 only), their scalars mirrored to each tracker of
    `report_to` (opened here, with `config` as the run's hyper-parameters)."""

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True, report_to: Sequence[str] = (),
                 config: dict[str, Any] | None = None, project: str = "kiln"):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._file: TextIO | None = None
        self._trackers = open_trackers(list(report_to), run_dir, project, config or {}) if enabled else []

    def truncate_after(self, step: int, report: Callable[[str], None] = print) -> None:
        """Keep only records up to `step` (a resume from the checkpoint at `step`). A line that is no record
        is appended to metrics.rejected.jsonl (as {"line": N, "text": ...}) and `report`ed, never lost."""
        if not self.enabled:
            return
        records, bad = split_metrics(self.path)
        if bad:
            rejected = self.path.with_name(REJECTED)
            with open(rejected, "a", encoding="utf-8") as f:
                f.writelines(json.dumps({"line": no, "text": text}) + "\n" for no, text in bad)
                f.flush()
                os.fsync(f.fileno())
            shown = ", ".join(str(no) for no, _ in bad[:5]) + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "")
            report(f"resume: {self.path}: line(s) {shown} hold no metrics record (not JSON, or no numeric step); "
                   f"kept aside in {rejected.name}; the {len(records)} valid record(s) stay")
        kept = [r for r in records if r["step"] <= step]
        write_text_atomic(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))

    def clear(self) -> None:
        """Drop every record (a restart from step 0 of a run that saved no checkpoint)."""
        if self.enabled and self.path.exists():
            self.path.unlink()

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held open across log() calls; close() closes it
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        values = scalars(record)
        if values:
            for tracker in self._trackers:
                tracker.log(record["step"], values)

    def sync(self) -> None:
        """fsync before a checkpoint, so every line up to its step survives a crash."""
        if self._file is not None:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []


class ProgressBar:
    """A rich progress bar over optimizer steps, showing loss and lr; silent when disabled."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.enabled = enabled
        if not enabled:
            return
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
        self.task = self.progress.add_task("train", total=total, completed=start, info="")
        self.progress.start()

    def update(self, step: int, info: str) -> None:
        if self.enabled:
            self.progress.update(self.task, completed=step, info=info)

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()
