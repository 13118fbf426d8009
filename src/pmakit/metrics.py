"""The run's metrics log: RUN/metrics.jsonl always (one JSON object a line), TensorBoard when installed.

Records carry ``kind`` (train, eval, snapshot, event), ``tokens`` and ``step``; evaluation records carry ``model``
(``latest`` or ``merged:<method>:<N>``) and ``val_loss``. Appending keeps a resumed run's history in one file.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from pmakit.runs import METRICS, atomic_open, read_jsonl


class MetricsLog:
    """Appends records to ``run_dir/metrics.jsonl`` (and TensorBoard scalars under ``run_dir/tb``)."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True) -> None:
        self.path = Path(run_dir) / METRICS
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self._start = time.time()
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tb"))
            except ImportError:  # tensorboard is an optional extra
                self._tb = None

    def resume_at(self, step: int, *, rollback_from: str | None = None) -> None:
        """The run resumes from its state at ``step``: records of later steps (written before a kill, about to be
        written again) are dropped, a torn last line too, and ``time`` continues from the last record kept.

        ``rollback_from``: the run goes back on purpose (``pmakit train --resume-from`` a recovered merge into the
        same run): the later records are the abandoned timeline, kept in ``metrics-rollback-step-S.jsonl`` beside
        this file, and an ``event: rollback`` record marks the jump.
        """
        records = read_metrics(self.path.parent)
        keep = [r for r in records if not isinstance(r.get("step"), int) or r["step"] <= step]
        times = [r["time"] for r in keep if isinstance(r.get("time"), (int, float))]
        self._start = time.time() - max(times, default=0.0)
        dropped = [r for r in records if r not in keep]
        if rollback_from is not None and dropped:
            aside = self.path.with_name(f"metrics-rollback-step-{step}.jsonl")
            aside.write_text("".join(json.dumps(r, default=_json_default) + "\n" for r in dropped))
            keep.append({"time": max(times, default=0.0), "kind": "event", "event": "rollback", "step": step,
                         "from": rollback_from, "abandoned": aside.name})  # fmt: skip
        if len(keep) == len(records) and _whole(self.path):
            return
        self._file.close()
        with atomic_open(self.path) as f:
            f.writelines(json.dumps(r, default=_json_default) + "\n" for r in keep)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        record = {"time": round(time.time() - self._start, 3), **record}
        self._file.write(json.dumps(record, default=_json_default) + "\n")
        self._file.flush()
        if self._tb is not None and "tokens" in record:
            prefix = record.get("model", record.get("kind", "train"))
            for key, value in record.items():
                scalar = isinstance(value, (int, float)) and math.isfinite(value)
                if scalar and key not in ("tokens", "step", "time"):
                    self._tb.add_scalar(f"{prefix}/{key}", value, record["tokens"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _whole(path: Path) -> bool:
    """Every line of ``path`` is a JSON record (no torn line left by a kill)."""
    text = path.read_text()
    if text and not text.endswith("\n"):
        return False
    try:
        for line in text.splitlines():
            json.loads(line)
    except ValueError:
        return False
    return True


def _json_default(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"cannot log {type(x).__name__}")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of ``run_dir/metrics.jsonl`` (a torn last line from a crash is ignored)."""
    return read_jsonl(Path(run_dir) / METRICS)
