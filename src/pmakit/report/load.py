"""Read an experiment run directory (experiment.json, results.csv, curves.csv) into typed rows.

Reading never fails on partial or damaged files: a missing file or an unreadable cell becomes ``None`` (never a
made-up number) and a note that the report shows, so that a half-finished run still gets a report.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pmakit.report.schema import PMA_COLUMNS
from pmakit.runs import RESULTS, RESULTS_CSV, read_jsonl

RESULT_COLUMNS = PMA_COLUMNS


@dataclass(frozen=True)
class Row:
    """One evaluated model (one line of results.csv); ``None`` where the file has no usable value."""

    fork_tokens: int | None
    """The fork point F the row belongs to; None for evaluations along the stable phase (E1)."""
    model: str
    """'latest', 'merged' or 'annealed'."""
    method: str
    """Weighting of a merge (sma, wma, ema, ...); '' for latest and annealed."""
    n: int | None
    """Number of snapshots merged."""
    v_tokens: int | None
    """Interval between the merged snapshots, in tokens."""
    alpha: float | None
    """EMA factor (EMA weightings only)."""
    tokens: int | None
    """Training tokens of the newest weights in the model."""
    window_start_tokens: int | None
    """Tokens of the oldest snapshot in the merge window."""
    val_loss: float | None
    """Mean validation loss, nats per token."""
    val_loss_se: float | None
    """Standard error of val_loss over the validation batches."""
    bpb: float | None
    """Bits per byte."""
    delta_vs_latest: float | None
    """val_loss minus the latest snapshot's val_loss at the same tokens (negative = better)."""
    delta_se: float | None
    """Paired standard error of delta_vs_latest over the same batches."""
    label: str
    """Short human description written by the experiment."""
    batch_losses: tuple[float, ...] | None = None
    """Per-batch losses (results.jsonl only): pairs any two models on the same batches."""
    split: str = ""
    """Held-out split scored: 'selection' (the grid, where choices are made), 'test' (the headline), '' (the
    whole held-out set, a run of an older pmakit)."""
    role: str = ""
    """On the test split: 'best' / 'best-sma' (chosen on the selection split), 'fixed' (SMA N=10, no choice),
    'tuned' (pmakit tune's search on the selection split); '' otherwise."""
    tune_trials: int | None = None
    """A tuned row (results.jsonl only): the search's trials."""
    tune_evaluations: int | None = None
    """... and the evaluations it made (the rest reused the grid's scores); None: every trial was evaluated."""
    tune_batches: int | None = None
    """... and the selection batches they scored (trials stopped early by racing scored fewer); None: unknown."""
    tune_stopped: int | None = None
    """... how many of them were stopped early."""
    tune_learned: int | None = None
    """... and the forward-backward batches its learned weights took (each about a training step's compute)."""

    @property
    def key(self) -> tuple[object, ...]:
        """What identifies one evaluation (the CSV and JSONL rows of one model share it)."""
        return (
            self.fork_tokens, self.model, self.method, self.n, self.v_tokens, self.alpha, self.tokens,
            self.split, self.role,
        )  # fmt: skip


@dataclass(frozen=True)
class CurvePoint:
    """One point of a loss-vs-tokens curve."""

    tokens: int
    """Training tokens at the evaluation."""
    val_loss: float
    """Validation loss, nats per token."""
    val_loss_se: float | None
    """Standard error over batches."""


@dataclass
class RunData:
    """Everything the report reads from one run directory."""

    run_dir: Path
    """The run directory."""
    experiment: dict[str, Any] = field(default_factory=dict)
    """experiment.json as written ({} when missing or unreadable)."""
    rows: list[Row] = field(default_factory=list)
    """results.csv (or results.jsonl when the CSV is missing)."""
    curves: dict[str, list[CurvePoint]] = field(default_factory=dict)
    """curves.csv by series name, each sorted by tokens."""
    notes: list[str] = field(default_factory=list)
    """What was missing or unreadable, for the reader of the report."""


def _float(value: Any) -> float | None:
    """A finite float or None (empty cell, text, NaN and inf all mean 'no number')."""
    if value is None or isinstance(value, bool):
        return None
    try:
        x = float(str(value).strip())
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def _int(value: Any) -> int | None:
    x = _float(value)
    return round(x) if x is not None and abs(x - round(x)) < 1e-6 * max(1.0, abs(x)) else None


def _text(value: Any) -> str:
    return "" if value is None else str(value).strip()


def _losses(value: Any) -> tuple[float, ...] | None:
    if not isinstance(value, list) or len(value) < 2:
        return None
    xs = tuple(_float(v) for v in value)
    return None if any(x is None for x in xs) else xs  # type: ignore[return-value]


_READ_AS: dict[str, Callable[[Any], Any]] = {
    "int | None": _int,
    "float | None": _float,
    "str": _text,
    "tuple[float, ...] | None": _losses,
}
"""How a cell is read, by the type ``Row`` declares for it."""
_LOWERED = ("model", "method", "split", "role")
"""Cells compared as keys: read in lower case."""
_TUNE = {
    "tune_trials": "trials", "tune_evaluations": "evaluations", "tune_batches": "batches_scored",
    "tune_stopped": "stopped_early", "tune_learned": "learned_batches",
}  # fmt: skip
"""The fields a tuned row reads from its ``tune`` record, and their names there."""


def parse_row(record: dict[str, Any]) -> Row:
    """One results record (CSV dict or JSON object) -> Row."""
    tune: dict[str, Any] = record["tune"] if isinstance(record.get("tune"), dict) else {}
    values: dict[str, Any] = {}
    for f in fields(Row):
        value = _READ_AS[str(f.type)](tune.get(_TUNE[f.name]) if f.name in _TUNE else record.get(f.name))
        values[f.name] = value.lower() if f.name in _LOWERED else value
    return Row(**values)


def _read_csv(path: Path) -> list[dict[str, Any]]:
    with path.open(newline="", encoding="utf-8", errors="replace") as f:
        return list(csv.DictReader(f))


def read_experiment(path: Path, notes: list[str]) -> dict[str, Any]:
    """experiment.json, or {} with a note when it is missing or not a JSON object."""
    if not path.is_file():
        notes.append("experiment.json is missing: no configuration, model size or timings to show.")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        notes.append(f"experiment.json is unreadable ({e.__class__.__name__}); it is ignored.")
        return {}
    if not isinstance(data, dict):
        notes.append("experiment.json is not a JSON object; it is ignored.")
        return {}
    return data


def read_results(run_dir: Path, notes: list[str]) -> list[Row]:
    """results.csv (results.jsonl as a fallback); rows without a model kind or a loss are dropped with a note."""
    csv_path, jsonl_path = run_dir / RESULTS_CSV, run_dir / RESULTS
    try:
        jsonl = [parse_row(r) for r in read_jsonl(jsonl_path)] if jsonl_path.is_file() else []
        if csv_path.is_file():
            rows = [parse_row(r) for r in _read_csv(csv_path)]
        elif jsonl:
            rows = jsonl
            notes.append("results.csv is missing; read results.jsonl instead.")
        else:
            notes.append("results.csv is missing: no evaluation results to show.")
            return []
    except (OSError, csv.Error) as e:
        notes.append(f"results are unreadable ({e.__class__.__name__}): no evaluation results to show.")
        return []
    # per-batch losses and the tuner's record (every tune_* field) live in the JSONL only; the last record of a model
    # wins, as in the CSV
    losses = {r.key: r.batch_losses for r in jsonl if r.batch_losses}
    rows = [replace(r, batch_losses=losses.get(r.key)) if r.batch_losses is None else r for r in rows]
    tuned = {r.key: r for r in jsonl if r.tune_trials is not None}
    rows = [
        replace(r, **{f.name: getattr(t, f.name) for f in fields(Row) if f.name.startswith("tune_")})
        if r.tune_trials is None and (t := tuned.get(r.key))
        else r
        for r in rows
    ]
    usable = [r for r in rows if r.model and r.val_loss is not None]
    if len(usable) < len(rows):
        notes.append(
            f"{len(rows) - len(usable)} result rows without a model kind or a val_loss were skipped."
        )
    return usable


def read_curves(path: Path, notes: list[str]) -> dict[str, list[CurvePoint]]:
    """curves.csv by series, sorted by tokens; points without tokens or loss are dropped."""
    if not path.is_file():
        notes.append("curves.csv is missing: no loss-vs-tokens curves to show.")
        return {}
    try:
        records = _read_csv(path)
    except (OSError, csv.Error) as e:
        notes.append(f"curves.csv is unreadable ({e.__class__.__name__}): no curves to show.")
        return {}
    curves: dict[str, list[CurvePoint]] = {}
    for r in records:
        series, tokens, loss = _text(r.get("series")), _int(r.get("tokens")), _float(r.get("val_loss"))
        if series and tokens is not None and loss is not None:
            curves.setdefault(series, []).append(CurvePoint(tokens, loss, _float(r.get("val_loss_se"))))
    for points in curves.values():
        points.sort(key=lambda p: p.tokens)
    return curves


def load_run(run_dir: Path) -> RunData:
    """Read the three experiment outputs of ``run_dir``; missing parts become notes, never errors."""
    notes: list[str] = []
    experiment = read_experiment(run_dir / "experiment.json", notes)
    rows = read_results(run_dir, notes)
    curves = read_curves(run_dir / "curves.csv", notes)
    return RunData(run_dir=run_dir, experiment=experiment, rows=rows, curves=curves, notes=notes)
