"""Loss-spike recovery: detect a spike, roll the run back onto a merge of its last snapshots before the spike.

Three pieces, each usable alone:

- ``SpikeDetector``: fed (tokens, loss, grad_norm) step by step, it compares each step with a robust baseline (median
  and MAD of the last ``window`` in-line steps) and reports a ``Spike`` once ``patience`` consecutive steps are out
  of line. The spike's ``start_tokens`` is the FIRST step of the excursion (widened back over the steps just before
  it that were already rising), not the step at which patience ran out: snapshots from the excursion must never be
  merged. A NaN/Inf loss is a spike at once. Pure and deterministic: the same series gives the same spikes.
- ``choose_rollback``: exactly the last K complete snapshots with tokens strictly below a boundary: for a detected
  spike, ``spike_boundary`` = its start minus one step's tokens, because a logged loss was measured on the weights
  from before that step's update.
- ``recover``: the offline command (``pmakit recover``) writes that merge as a resumable snapshot with a record of
  what was merged and why.

The same policy during training is ``pmakit.train.spike_recovery.SpikeRecovery``; this module imports no trainer.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import os
import shutil
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pmakit
from pmakit.config import Tokens
from pmakit.errors import PmakitError
from pmakit.runs import (
    KEPT_CHECKPOINTS,
    METRICS,
    checkpoint_dir,
    replace_dir,
    snapshots_dir,
)
from pmakit.snapshot import METADATA_FILE, IncompleteSnapshot, Snapshot, read_snapshot, sort_snapshots
from pmakit.units import format_tokens

log = logging.getLogger(__name__)

MAD_TO_SIGMA = 1.4826
"""MAD x this estimates the standard deviation of normal noise."""
OPTIMIZER_POLICIES = ("reset", "keep-latest")


# --------------------------------------------------------------------------------------------------- detection


@dataclass(frozen=True)
class SpikeConfig:
    """When a run of out-of-line training steps counts as a loss spike."""

    window: int = 50
    """In-line steps in the baseline (their median and MAD)."""
    threshold: float = 6.0
    """A step is out of line when its loss is this many robust standard deviations (1.4826 x MAD) above the median."""
    grad_threshold: float | None = None
    """The same test on the gradient norm (a non-finite grad norm is out of line too); None watches the loss only."""
    patience: int = 3
    """Consecutive out-of-line steps that make a spike (1: any single step)."""
    min_history: int = 20
    """In-line steps needed in the baseline before a step is judged (a NaN/Inf loss is judged at once)."""
    warmup_tokens: Tokens = 0
    """Steps before this many tokens are ignored: during LR warmup the loss and grad norm move fast by design."""
    onset: float | None = 3.0
    """Steps just before the excursion whose z exceeds this are counted into it, so that its start is not late."""
    min_rel_scale: float = 0.002
    """Floor of the robust scale as a fraction of the median, so that a flat loss does not make every wiggle a spike."""

    def __post_init__(self) -> None:
        if self.window < 3:
            raise PmakitError(f"spike window must be at least 3 steps, got {self.window}")
        if not 1 <= self.min_history <= self.window:
            raise PmakitError(
                f"spike min_history must be in [1, window={self.window}], got {self.min_history}"
            )
        if self.patience < 1:
            raise PmakitError(f"spike patience must be at least 1, got {self.patience}")
        for name in ("threshold", "grad_threshold"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise PmakitError(f"spike {name} must be a positive number, got {value}")
        if self.onset is not None and not 0 < self.onset <= self.threshold:
            raise PmakitError(f"spike onset must be in (0, threshold={self.threshold}], got {self.onset}")
        if self.min_rel_scale < 0 or self.warmup_tokens < 0:
            raise PmakitError("spike min_rel_scale and warmup_tokens must be non-negative")


@dataclass(frozen=True)
class Spike:
    """A detected loss spike."""

    start_tokens: int
    """Tokens of the first step of the excursion. Its loss was measured on the weights one step earlier, so
    snapshots from ``spike_boundary(spike, tokens_per_step)`` on are never merged."""
    start_step: int | None
    """Step of the first step of the excursion, when steps were given."""
    detected_tokens: int
    """Tokens of the step at which the spike was reported."""
    detected_step: int | None
    """Step at which the spike was reported."""
    reason: str
    """``non-finite loss``, ``loss``, ``grad norm`` or ``loss+grad norm``: what was out of line."""
    loss: float
    """The loss at detection."""
    baseline: float | None
    """The median loss of the baseline before the spike (None when the baseline was too short)."""
    z: float | None
    """The largest robust z of the loss over the excursion (None when no step could be judged)."""
    steps: int
    """Steps from the start to the detection, both included."""
    previous_tokens: int | None = None
    """Tokens of the record just before the start (None for the first record): see ``spike_boundary``."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe record (non-finite numbers as strings, since JSON has no NaN)."""
        return {k: _json_number(v) for k, v in asdict(self).items()}

    def describe(self) -> str:
        """One line for a user: where it started, where it was caught, how big it is."""
        at = f"{format_tokens(self.start_tokens)} tokens" + (
            "" if self.start_step is None else f" (step {self.start_step})"
        )
        size = f"loss {self.loss:.4g}"
        if self.baseline is not None:
            size += f" vs baseline {self.baseline:.4g}"
        if self.z is not None and math.isfinite(self.z):
            size += f", z={self.z:.1f}"
        return (
            f"{self.reason} spike starting at {at}, detected at {format_tokens(self.detected_tokens)} "
            f"tokens after {self.steps} step(s): {size}"
        )


def _json_number(v: Any) -> Any:
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


@dataclass(frozen=True)
class _Point:
    tokens: int
    step: int | None
    loss: float
    grad_norm: float | None
    z_loss: float | None
    z_grad: float | None
    prev_tokens: int | None = None  # the record seen just before this one

    @property
    def z(self) -> float:
        """The larger of the two z scores, for the onset test (-inf when neither could be computed)."""
        zs = [z for z in (self.z_loss, self.z_grad) if z is not None]
        return max(zs) if zs else -math.inf


def robust_z(value: float, history: Sequence[float], min_rel_scale: float) -> float:
    """(value - median) / (1.4826 x MAD), the scale floored at ``min_rel_scale`` x |median| (and 1e-12)."""
    med = statistics.median(history)
    mad = statistics.median(abs(v - med) for v in history)
    scale = max(MAD_TO_SIGMA * mad, min_rel_scale * abs(med), 1e-12)
    return (value - med) / scale


class SpikeDetector:
    """Watches a training run step by step and reports loss spikes (see the module docstring).

    Steps out of line are kept out of the baseline while they last; if they stop before ``patience`` (a blip),
    they join it, so that the baseline's spread reflects the run's real noise. After a spike is reported the
    detector stays quiet until ``patience`` consecutive in-line steps have passed (one excursion, one report), or
    until ``rewind``/``reset``. A token count at or below the previous step's (a resumed or rolled-back run logging
    again) rewinds the detector to that point first.

    The loss test is one-sided (only rises count) and a pure linear drift cannot trigger it: the next point of a
    ramp sits (w+1)/2 slopes above the median of the last w points, and their MAD is w/4 slopes, so its z is
    2(w+1) / (1.4826 w), 1.38 for w=50, whatever the slope.
    """

    def __init__(self, config: SpikeConfig | None = None) -> None:
        self.config = config or SpikeConfig()
        self.reset()

    def reset(self) -> None:
        """Forget everything."""
        window = self.config.window
        self._history: deque[_Point] = deque(maxlen=window)  # in-line steps: the baseline
        self._recent: deque[_Point] = deque(maxlen=window)  # judged in-line steps, newest last, for the onset
        self._run: list[_Point] = []  # the excursion in progress
        self._latched: Spike | None = None  # the spike reported last, until the run is back in line
        self._calm = 0
        self._last_tokens: int | None = None

    def rewind(self, tokens: int) -> None:
        """Forget every step at or after ``tokens`` (the run was rolled back to there) and any spike in progress."""
        self._history = deque((p for p in self._history if p.tokens < tokens), maxlen=self.config.window)
        self._recent = deque((p for p in self._recent if p.tokens < tokens), maxlen=self.config.window)
        self._run = []
        self._latched = None
        self._calm = 0
        self._last_tokens = self._history[-1].tokens if self._history else None

    @property
    def in_spike(self) -> bool:
        """True between a reported spike and the run's return in line."""
        return self._latched is not None

    @property
    def baseline(self) -> float | None:
        """The median loss of the baseline, None while it is empty."""
        return statistics.median(p.loss for p in self._history) if self._history else None

    def update(
        self, tokens: int, loss: float, grad_norm: float | None = None, *, step: int | None = None
    ) -> Spike | None:
        """Judge one training step; returns the spike when this step completes one, else None."""
        cfg = self.config
        if self._last_tokens is not None and tokens <= self._last_tokens:
            self.rewind(tokens)
        prev, self._last_tokens = self._last_tokens, tokens
        loss = float(loss)
        if not math.isfinite(loss):
            # A NaN/Inf loss cannot recover by itself: a spike now, even in warmup, unless one is already open.
            point = _Point(tokens, step, loss, grad_norm, math.inf, None, prev)
            if self._latched is not None:
                self._calm = 0
                return None
            return self._report([*self._run, point], "non-finite loss")
        if tokens < cfg.warmup_tokens:
            return None
        point = dataclasses.replace(self._judge(tokens, step, loss, grad_norm), prev_tokens=prev)
        out_of_line = self._out_of_line(point)
        if self._latched is not None:
            if out_of_line:
                self._calm = 0
                return None
            self._keep(point)
            self._calm += 1
            if self._calm >= cfg.patience:
                self._latched = None
            return None
        if out_of_line:
            self._run.append(point)
            if len(self._run) >= cfg.patience:
                return self._report(self._run, self._reason(self._run))
            return None
        for blip in self._run:  # shorter than patience: noise, and part of the baseline's spread
            self._keep(blip)
        self._run = []
        self._keep(point)
        return None

    def _judge(self, tokens: int, step: int | None, loss: float, grad_norm: float | None) -> _Point:
        cfg = self.config
        judged = len(self._history) >= cfg.min_history
        z_loss = robust_z(loss, [p.loss for p in self._history], cfg.min_rel_scale) if judged else None
        z_grad = None
        if cfg.grad_threshold is not None and grad_norm is not None:
            if not math.isfinite(grad_norm):
                z_grad = math.inf
            elif judged:
                grads = [p.grad_norm for p in self._history if p.grad_norm is not None]
                grads = [g for g in grads if math.isfinite(g)]
                if len(grads) >= cfg.min_history:
                    z_grad = robust_z(grad_norm, grads, cfg.min_rel_scale)
        return _Point(tokens, step, loss, grad_norm, z_loss, z_grad)

    def _out_of_line(self, p: _Point) -> bool:
        cfg = self.config
        loss_out = p.z_loss is not None and p.z_loss > cfg.threshold
        grad_out = cfg.grad_threshold is not None and p.z_grad is not None and p.z_grad > cfg.grad_threshold
        return loss_out or grad_out

    def _reason(self, run: Sequence[_Point]) -> str:
        cfg = self.config
        loss_out = any(p.z_loss is not None and p.z_loss > cfg.threshold for p in run)
        grad_out = cfg.grad_threshold is not None and any(
            p.z_grad is not None and p.z_grad > cfg.grad_threshold for p in run
        )
        return "loss+grad norm" if loss_out and grad_out else "loss" if loss_out else "grad norm"

    def _keep(self, p: _Point) -> None:
        self._history.append(p)
        if p.z_loss is not None or p.z_grad is not None:
            self._recent.append(p)
        else:
            self._recent.clear()  # an unjudged step breaks the chain of steps the onset may widen over

    def _report(self, run: Sequence[_Point], reason: str) -> Spike:
        first = run[0]
        onset = self.config.onset
        if onset is not None:
            # Widen the start back over the contiguous steps just before that were already rising.
            for p in reversed(self._recent):
                if p.z < onset or p.tokens >= first.tokens:
                    break
                first = p
        zs = [p.z_loss for p in run if p.z_loss is not None]
        spike = Spike(
            start_tokens=first.tokens,
            start_step=first.step,
            detected_tokens=run[-1].tokens,
            detected_step=run[-1].step,
            reason=reason,
            loss=run[-1].loss,
            baseline=self.baseline,
            z=max(zs) if zs else None,
            steps=len(run) + sum(1 for p in self._recent if first.tokens <= p.tokens < run[0].tokens),
            previous_tokens=first.prev_tokens,
        )
        self._latched = spike
        self._calm = 0
        self._run = []
        return spike


def find_spikes(records: Iterable[dict[str, Any]], config: SpikeConfig | None = None) -> list[Spike]:
    """Every spike in a run's metrics records (``{"kind": "train", "tokens", "loss", "grad_norm", "step"}``)."""
    detector = SpikeDetector(config)
    spikes = []
    for r in records:
        if r.get("kind", "train") != "train" or "tokens" not in r or "loss" not in r:
            continue
        grad = r.get("grad_norm")
        spike = detector.update(
            int(r["tokens"]),
            _as_float(r["loss"]),
            None if grad is None else _as_float(grad),
            step=r.get("step") if isinstance(r.get("step"), int) else None,
        )
        if spike is not None:
            spikes.append(spike)
    return spikes


def _as_float(v: Any) -> float:
    """A logged number; null or unreadable counts as NaN (strict JSON writers turn NaN into null)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


# ---------------------------------------------------------------------------------------------------- rollback


def choose_rollback(
    snapshots: Sequence[Snapshot], spike_start_tokens: int, k: int = 3, *, allow_fewer: bool = False
) -> list[Snapshot]:
    """The last ``k`` complete snapshots with tokens strictly below ``spike_start_tokens``, oldest first.

    A snapshot exactly at the spike's start is excluded: its weights may already carry the first bad update.
    With fewer than ``k`` before the start this is an error (the merge would silently differ from what was asked),
    unless ``allow_fewer`` (the training callback's choice: merging 2 beats stopping), which takes what there is.
    No snapshot before the start is always an error.

    Example: snapshots at 100, 200, ..., 1000 tokens, spike starting at 700, k=3 -> [400, 500, 600].
    """
    if k < 1:
        raise PmakitError(f"--last must be at least 1, got {k}")
    ordered = sort_snapshots(snapshots)
    pool = [s for s in ordered if s.tokens < spike_start_tokens]
    if not pool:
        oldest = f" (the oldest is at {format_tokens(ordered[0].tokens)})" if ordered else ""
        raise PmakitError(
            f"no complete snapshot before {format_tokens(spike_start_tokens)} tokens{oldest}: nothing to roll back to"
        )
    if len(pool) < k and not allow_fewer:
        raise PmakitError(
            f"--last {k} asks for {k} snapshots before {format_tokens(spike_start_tokens)} tokens but only "
            f"{len(pool)} exist; pass --last {len(pool)}"
        )
    return pool[-k:]


# ----------------------------------------------------------------------------------------------------- recover


@dataclass(frozen=True)
class RecoveryResult:
    """A written recovery snapshot."""

    path: Path
    """The output snapshot directory."""
    snapshots: list[Snapshot]
    """The merged snapshots, oldest first."""
    weights: list[float]
    """Their weights."""
    before_tokens: int
    """Only snapshots with tokens strictly below this were eligible."""
    spike: Spike | None
    """The spike found in the metrics log (None when ``before`` was given)."""
    optimizer_from: Snapshot | None
    """The full checkpoint whose optimizer state was copied (``keep-latest``), else None."""
    record: dict[str, Any] = field(default_factory=dict)
    """The ``recovery`` record written into the output's pmakit.json."""


def snapshot_dir(run_dir: Path) -> Path:
    """Where a run keeps its snapshots: ``RUN/snapshots`` when it exists (``pmakit train``), else RUN itself."""
    sub = snapshots_dir(run_dir)
    return sub if sub.is_dir() else run_dir


def spike_from_metrics(run_dir: Path, config: SpikeConfig | None = None) -> tuple[Spike, list[Spike], int]:
    """The spike to recover from (the last one found in RUN/metrics.jsonl), all spikes found, and the loss lag.

    The loss lag (``loss_lag_tokens``) is how many tokens before a train record's ``tokens`` the weights it was
    measured on were saved: one step's tokens (see ``spike_boundary``).
    """
    from pmakit.metrics import read_metrics

    metrics = run_dir / METRICS
    if not metrics.is_file():
        raise PmakitError(f"{metrics} not found: pass --before TOKENS to say where the spike began")
    records = read_metrics(run_dir)  # a torn last line (a crash mid-write) is skipped
    train = [r for r in records if r.get("kind", "train") == "train" and "loss" in r and "tokens" in r]
    cfg = config or SpikeConfig()
    spikes = find_spikes(train, cfg)
    if not spikes:
        raise PmakitError(
            f"no loss spike found in {metrics} ({len(train)} training records; window {cfg.window}, threshold "
            f"{cfg.threshold:g}, patience {cfg.patience}): pass --before TOKENS, or a lower --threshold"
        )
    rolled_back = [
        r["tokens"]
        for r in records
        if r.get("kind") == "event"
        and r.get("event") == "rollback"
        and r.get("tokens", -1) >= spikes[-1].detected_tokens
    ]
    if rolled_back:
        log.warning(
            "the last spike in %s (%s) was already rolled back during training at %s tokens",
            metrics,
            spikes[-1].describe(),
            rolled_back[0],
        )
    return spikes[-1], spikes, loss_lag_tokens(train)


def loss_lag_tokens(records: Sequence[dict[str, Any]]) -> int:
    """Tokens of one step, from train records: the median of d(tokens)/d(step) over consecutive records with steps.

    Without step numbers, the smallest gap between consecutive records' tokens: when records are logged every k
    steps this overestimates the lag k-fold, which only excludes more snapshots (the safe side).
    """
    rates, gaps = [], []
    for a, b in zip(records, records[1:]):
        dt = int(b["tokens"]) - int(a["tokens"])
        if dt <= 0:
            continue
        gaps.append(dt)
        sa, sb = a.get("step"), b.get("step")
        if isinstance(sa, int) and isinstance(sb, int) and sb > sa:
            rates.append(dt / (sb - sa))
    if rates:
        return math.ceil(statistics.median(rates))
    return min(gaps) if gaps else 0


def spike_boundary(spike: Spike, loss_lag_tokens: int) -> int:
    """Snapshots strictly below this are safe to merge.

    A train record's loss is measured on the weights BEFORE its step's update, while its ``tokens`` count that
    step: the first out-of-line loss, logged at T tokens, came from the weights saved at T - (one step's tokens),
    the first known-bad weights, so the boundary is at most ``spike.start_tokens - loss_lag_tokens``. When records
    are sparser than steps (logged every k steps), the weights between the last in-line record and the first bad
    one were never measured: the boundary is then the previous record's tokens (the weights saved there produced
    the first loss not logged). With a record per step both are the same.
    """
    boundary = spike.start_tokens - loss_lag_tokens
    if spike.previous_tokens is not None:
        boundary = min(boundary, spike.previous_tokens)
    return boundary


def recover(
    run_dir: str | os.PathLike[str],
    *,
    out: str | os.PathLike[str],
    before: int | None = None,
    last: int = 3,
    method: str = "sma",
    alpha: float = 0.2,
    optimizer: str = "reset",
    detector: SpikeConfig | None = None,
    allow_fewer: bool = False,
    force: bool = False,
) -> RecoveryResult:
    """Write the merge of the last ``last`` snapshots before a spike as a snapshot a trainer can resume from.

    Args:
        run_dir: the run (snapshots in ``RUN/snapshots/`` or directly in RUN; ``RUN/metrics.jsonl``;
            ``RUN/checkpoint/`` for ``keep-latest``).
        out: the output snapshot directory (built in a hidden sibling, renamed into place when complete).
        before: merge only snapshots with tokens strictly below this; None finds the spike in
            ``RUN/metrics.jsonl`` with ``detector`` (the last spike there, when there are several) and uses
            ``spike_boundary``: its start minus one step's tokens.
        last: K, how many snapshots to merge.
        method, alpha: the weighting (``pmakit.weights``).
        optimizer: ``reset`` (no optimizer state: the trainer starts a fresh one) or ``keep-latest`` (copy the
            optimizer state of the newest full checkpoint before the spike; an error if there is none).
        allow_fewer: merge what there is when fewer than ``last`` snapshots precede the spike.
        force: replace ``out`` if it exists.
    """
    from pmakit.snapshot import discover
    from pmakit.weights import get_weights

    run_dir, out = Path(run_dir), Path(out)
    snap_dir = _check_request(run_dir, out, optimizer, force)
    spike, spikes, lag = (None, [], 0) if before is not None else spike_from_metrics(run_dir, detector)
    if spike is not None:
        before = spike_boundary(spike, lag)
        if len(spikes) > 1:
            log.warning("%d spikes in the metrics log; recovering from the last one", len(spikes))
    assert before is not None
    snapshots = discover(snap_dir)
    if not snapshots:
        raise PmakitError(f"{snap_dir}: no complete snapshots (each needs weights and {METADATA_FILE})")
    chosen = choose_rollback(snapshots, before, last, allow_fewer=allow_fewer)
    weights = get_weights(method, len(chosen), alpha=alpha)
    source = latest_optimizer_checkpoint(run_dir, snapshots, before) if optimizer == "keep-latest" else None
    if optimizer == "keep-latest" and source is None:
        raise PmakitError(
            f"--optimizer keep-latest: no full checkpoint with optimizer state before {format_tokens(before)} "
            f"tokens in {checkpoint_dir(run_dir)}, {run_dir / KEPT_CHECKPOINTS}/ or beside the snapshots "
            "(snapshots hold weights only); "
            "use --optimizer reset"
        )
    why = Why(before, spike, spikes, lag, detector)
    record = _record(run_dir, why, method, alpha, last, chosen, weights, optimizer, source)
    _write_recovered(run_dir, out, chosen, weights, method, alpha, source, record)
    return RecoveryResult(out, chosen, weights, before, spike, source, record)


def _check_request(run_dir: Path, out: Path, optimizer: str, force: bool) -> Path:
    """Refuse what cannot work before any reading; returns the run's snapshot folder."""
    if not run_dir.is_dir():
        raise PmakitError(f"{run_dir}: no such run directory")
    if optimizer not in OPTIMIZER_POLICIES:
        raise PmakitError(f"unknown optimizer policy {optimizer!r}; use {' or '.join(OPTIMIZER_POLICIES)}")
    snap_dir = snapshot_dir(run_dir)
    if _inside(out, snap_dir):
        raise PmakitError(
            f"{out} is inside the run's snapshot folder {snap_dir}: it would be taken for a training snapshot "
            "by later merges; write it elsewhere"
        )
    if _inside(out, run_dir):
        log.warning(
            "%s is inside the run directory: `pmakit merge %s` will count it as a snapshot", out, run_dir
        )
    if out.exists() and not force:
        raise PmakitError(f"{out} exists; pass --force to replace it")
    return snap_dir


@dataclass(frozen=True)
class Why:
    """Where the rollback boundary came from: ``--before``, or a spike found in the metrics log."""

    before: int
    spike: Spike | None
    spikes: list[Spike]
    lag: int
    detector: SpikeConfig | None


def _record(
    run_dir: Path,
    why: Why,
    method: str,
    alpha: float,
    last: int,
    chosen: list[Snapshot],
    weights: list[float],
    optimizer: str,
    source: Snapshot | None,
) -> dict[str, Any]:
    """The ``recovery`` record of the output's pmakit.json: what was merged, with which weights, and why."""
    before, spike, spikes, lag, detector = why.before, why.spike, why.spikes, why.lag, why.detector
    return {
        "run_dir": str(run_dir.resolve()),
        "before_tokens": before,
        "why": "--before given"
        if spike is None
        else f"a loss spike in metrics.jsonl; its first out-of-line loss, logged at {spike.start_tokens} tokens, "
        f"was measured on the weights of {before} tokens ({lag} tokens per step earlier)",
        "loss_lag_tokens": lag,
        "spike": spike.to_dict() if spike is not None else None,
        "spikes_found": len(spikes),
        "detector": asdict(detector or SpikeConfig()) if spike is not None else None,
        "method": method,
        "alpha": alpha,
        "last": last,
        "merged": [
            {"path": str(s.path.resolve()), "step": s.step, "tokens": s.tokens, "weight": w}
            for s, w in zip(chosen, weights)
        ],
        "weights": weights,
        "optimizer": optimizer,
        "optimizer_from": None
        if source is None
        else {"path": str(source.path.resolve()), "step": source.step, "tokens": source.tokens},
        "pmakit_version": pmakit.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _write_recovered(
    run_dir: Path,
    out: Path,
    chosen: list[Snapshot],
    weights: list[float],
    method: str,
    alpha: float,
    source: Snapshot | None,
    record: dict[str, Any],
) -> None:
    """The merge, the tokenizer and (keep-latest) the optimizer state, pmakit.json last, renamed into place."""
    from pmakit.merge import merge

    newest = chosen[-1]
    staging = out.parent / f".{out.name}.pmakit-recover"
    shutil.rmtree(staging, ignore_errors=True)  # left by an interrupted recover into the same OUT
    try:
        merge(chosen, weights, staging, manifest_extra={"method": method, "alpha": alpha, "recovery": True})
        _copy_tokenizer(run_dir, staging)
        if source is not None:
            _copy_optimizer(source.path, staging)
        # pmakit.json last: only now is the directory a complete snapshot.
        from pmakit.snapshot import write_metadata

        write_metadata(
            staging,
            step=newest.step,  # type: ignore[arg-type]  # None for snapshots that never knew their step
            tokens=newest.tokens,
            lr=newest.lr,
            loss=None,
            recovery=record,
        )
        replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


OPTIMIZER_PREFIX = "optimizer"
"""Files whose names start with this hold optimizer state (``optimizer.pt``, HF Trainer's too)."""


def _has_optimizer(directory: Path) -> bool:
    return directory.is_dir() and any(
        f.is_file() and f.name.startswith(OPTIMIZER_PREFIX) for f in directory.iterdir()
    )


def latest_optimizer_checkpoint(run_dir: Path, snapshots: Sequence[Snapshot], before: int) -> Snapshot | None:
    """The newest directory with optimizer state and known tokens strictly below ``before``.

    Looked for in ``RUN/checkpoint/`` (the trainer overwrites it, so it is often past the spike),
    ``RUN/checkpoints/*/`` (full states kept at chosen token counts) and the snapshot directories (when they hold
    one, as HF Trainer checkpoints do).
    """
    candidates = [s for s in snapshots if _has_optimizer(s.path)]
    kept = run_dir / KEPT_CHECKPOINTS
    for d in [checkpoint_dir(run_dir), *(sorted(kept.iterdir()) if kept.is_dir() else [])]:
        if _has_optimizer(d):
            try:
                candidates.append(read_snapshot(d))
            except IncompleteSnapshot as e:
                log.warning("ignoring %s", e)
    eligible = [s for s in candidates if s.tokens < before]
    return max(eligible, key=lambda s: s.tokens) if eligible else None


def _copy_optimizer(source: Path, target: Path) -> None:
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name.startswith(OPTIMIZER_PREFIX):
            shutil.copy2(f, target / f.name)


def _copy_tokenizer(run_dir: Path, target: Path) -> None:
    """``RUN/tokenizer/`` files the snapshots did not carry, so that AutoTokenizer loads the output too."""
    tok = run_dir / "tokenizer"
    if not tok.is_dir():
        return
    for f in sorted(tok.iterdir()):
        if f.is_file() and not (target / f.name).exists():
            shutil.copy2(f, target / f.name)


def _inside(path: Path, directory: Path) -> bool:
    path, directory = path.resolve(), directory.resolve()
    return path == directory or directory in path.parents


DISCARDED_DIR = "discarded"
"""``RUN/discarded/spike-T/``: snapshots saved during a spike, moved out of the snapshot folder."""


def merged_state(
    snapshots: Sequence[Snapshot], method: str, alpha: float
) -> tuple[dict[str, Any], list[float]]:
    """What ``pmakit merge`` writes for ``snapshots``, as a state dict in memory (bit for bit the same: the engine's
    arithmetic and dtypes), and the weights. One snapshot is read at a time: the sums and one state in memory.

    A NaN/Inf in a snapshot is an error naming the tensor and the snapshot, as in ``merge``.
    """
    from pmakit.merge import average_states
    from pmakit.weights import get_weights

    weights = get_weights(method, len(snapshots), alpha=alpha)
    return average_states((read_finite_state(s) for s in snapshots), weights, dtype="same"), weights


def read_finite_state(snapshot: Snapshot) -> dict[str, Any]:
    """The tensors of ``snapshot``; NaN or Inf in a float tensor is one error naming the tensor and snapshot."""
    import torch

    from pmakit.formats import is_float, read_state

    state = read_state(snapshot.path)
    for name, t in state.items():
        if is_float(t.dtype) and not torch.isfinite(t).all():
            raise PmakitError(
                f"non-finite values (NaN/Inf) in tensor {name!r} of {snapshot.path} (step {snapshot.step}, "
                f"{snapshot.tokens} tokens): it cannot be merged"
            )
    return state
