"""Two more presets of ``pmakit experiment``: loss-spike recovery (paper E10) and PMA-init (paper E9).

Both are selected by the config key ``study: spike | init`` (set in presets ``spike.yaml`` / ``init.yaml``) and
write into the same run-directory layout as the main study, for the same report machinery:

- RUN/results.csv, RUN/results.jsonl: one row per (seed, stage, arm), columns ``STUDY_COLUMNS`` (below);
- RUN/curves.csv: held-out loss vs tokens of every arm and seed (series, tokens, val_loss, val_loss_se, arm, seed);
- RUN/train_curves.csv: the per-step training loss, gradient norm and LR of every arm and seed;
- RUN/experiment.json: ``"study"``, the config, the detected spikes (spike study), times and machine load;
- RUN/report.md / report.html: written by ``pmakit.report`` (its ``recovery`` part).

Spike study, per seed (the seed changes the initialisation and the data order; the corpus and the held-out batches
are the same for every seed):

1. ``seed-S/run``: warmup, constant LR, a snapshot every V; from ``push_at`` the LR is multiplied by
   ``push_factor`` for ``push_tokens`` (the induced instability), then back to the stable LR until
   ``train.total_tokens``. This run is the **no-intervention** arm. Full checkpoints (weights + optimizer) are
   kept at every snapshot time around the push.
2. The ``SpikeDetector`` (``pmakit.recover``) reads its per-step training log; the first spike that starts after
   ``push_at`` (the first pushed update) is the one recovered from (earlier ones are reported as false alarms). ``choose_rollback``
   picks the last K snapshots strictly before its boundary, exactly as ``SpikeRecovery`` does in a user's run.
3. Arms, all starting at the newest chosen snapshot's tokens T and trained to ``train.total_tokens`` on the same
   data stream: ``latest/<opt>`` (the newest pre-spike snapshot) and ``sma<K>/<opt>`` (the SMA of the K chosen
   snapshots), for each optimizer policy ``reset`` (fresh AdamW moments) and ``keep`` (the moments saved in the
   full checkpoint at T). Their LR is explicit: ``resume_lr: base`` (the stable-phase LR, the push is over) or
   ``pushed`` (the run's own schedule, push included), times ``resume_lr_factor``.

Init study, per seed: ``seed-S/run`` trains at constant LR to ``init_at``; then two arms continue training for
``continue_tokens`` with a new schedule (linear warmup then cosine decay) and a fresh optimizer, one from the
latest snapshot and one from the SMA of the last N snapshots.

Every arm is scored on the same fixed held-out batches (``train.eval_batches`` of them) every ``train.eval_every``
snapshots, and at the end; differences between arms are paired over those batches within a seed, and spread over
seeds for the across-seed standard errors. Re-running into the same directory resumes: arms with a final row are
not trained again, an interrupted arm resumes from its own checkpoint; a config that differs only by added seeds
runs the new seeds and keeps the others. The online merge of the loop is not used
(``average_last`` is forced to 1) and per-step train records are forced (``log_every`` 1) for the detector and the
gradient-norm curves.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import torch

import pmakit
from pmakit.config import (
    AT_LEAST_1,
    AT_LEAST_2,
    NON_NEGATIVE,
    POSITIVE,
    Length,
    OneOf,
    Range,
    Tokens,
    check_fields,
    from_mapping,
)
from pmakit.errors import PmakitError
from pmakit.evaluate import EvalResult, paired_difference
from pmakit.lab.context import jsonable, open_run, utc_now
from pmakit.lab.results import ResultRows, write_csv
from pmakit.lab.scoring import SplitScorer
from pmakit.merge import average_states
from pmakit.report.schema import RECOVERY_COLUMNS, RECOVERY_CURVE_COLUMNS, RECOVERY_TRAIN_CURVE_COLUMNS
from pmakit.runs import (
    RESULTS,
    RESULTS_CSV,
    atomic_write_text,
    checkpoint_dir,
    kept_checkpoint_dir,
    snapshots_dir,
    trainer_state,
)
from pmakit.train.loop import TrainConfig, Trainer
from pmakit.units import format_tokens

if TYPE_CHECKING:
    from pmakit.snapshot import Snapshot

log = logging.getLogger(__name__)

STUDIES = ("spike", "init")
STUDY_COLUMNS = RECOVERY_COLUMNS
"""results.csv columns (``pmakit.report.schema.RECOVERY_COLUMNS`` says what each holds)."""
CURVE_COLUMNS = RECOVERY_CURVE_COLUMNS
TRAIN_CURVE_COLUMNS = RECOVERY_TRAIN_CURVE_COLUMNS
NO_INTERVENTION = "no-intervention"


# --------------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class SpikeStudyConfig:
    """The ``spike:`` section: the induced instability, the detector, the arms and how they resume."""

    seeds: Annotated[tuple[Annotated[int, NON_NEGATIVE], ...], Length(1, distinct=True)] = (0, 1, 2)
    """Training seeds (initialisation and data order); one full set of arms per seed."""
    push_at: Annotated[Tokens, AT_LEAST_1] = 409_600
    """Tokens at which the LR push (the induced instability) starts."""
    push_factor: Annotated[float, POSITIVE] = 40.0
    """The LR is multiplied by this during the push."""
    push_tokens: Annotated[Tokens, AT_LEAST_1] = 61_440
    """Length of the push; after it the no-intervention run goes back to the stable-phase LR."""
    last: Annotated[int, AT_LEAST_2] = 3
    """K: the merge arm averages the last K snapshots before the spike's boundary."""
    method: str = "sma"
    """Weighting of the K snapshots."""
    optimizers: Annotated[tuple[Annotated[str, OneOf(("reset", "keep"))], ...], Length(1)] = ("reset", "keep")
    """Optimizer policies of the resumed arms: reset (fresh AdamW) and keep (the state saved at the resume point)."""
    resume_lr: Annotated[str, OneOf(("base", "pushed"))] = "base"
    """LR of the resumed arms: base (the stable-phase LR from the resume point on) or pushed (the run's own
    schedule, the rest of the push included)."""
    resume_lr_factor: Annotated[float, POSITIVE] = 1.0
    """The resumed arms' LR is further multiplied by this."""
    detector: dict[str, Any] = field(default_factory=dict)
    """``pmakit.recover.SpikeConfig`` fields (window, threshold, patience, ...); warmup_tokens defaults to the
    run's warmup."""

    def __post_init__(self) -> None:
        from pmakit.weights import get_weights

        check_fields(self, "spike")  # the bounds declared above
        get_weights(self.method, self.last)
        self.spike_config(0)  # a bad detector key fails here

    def spike_config(self, warmup_tokens: int) -> Any:
        from pmakit.recover import SpikeConfig

        return from_mapping(SpikeConfig, {"warmup_tokens": warmup_tokens, **self.detector}, "spike.detector")

    @property
    def merge_arm(self) -> str:
        return f"{self.method}{self.last}"


@dataclass(frozen=True)
class InitStudyConfig:
    """The ``init:`` section: continued training from a merge vs from the latest snapshot."""

    seeds: Annotated[tuple[Annotated[int, NON_NEGATIVE], ...], Length(1, distinct=True)] = (0, 1, 2)
    """Training seeds (initialisation and data order)."""
    init_at: Annotated[Tokens, AT_LEAST_1] = 614_400
    """Tokens of the constant-LR run at which continued training starts (a snapshot time)."""
    n: Annotated[int, AT_LEAST_2] = 8
    """N: the merge arm starts from the SMA (``method``) of the last N snapshots up to ``init_at``."""
    method: str = "sma"
    """Weighting of the N snapshots."""
    continue_tokens: Annotated[Tokens, AT_LEAST_1] = 307_200
    """Length of the continued training."""
    warmup_tokens: Annotated[Tokens, NON_NEGATIVE] = 20_480
    """Linear warmup of the new schedule (from 0 to the peak)."""
    peak_lr_factor: Annotated[float, POSITIVE] = 1.0
    """Peak LR of the new schedule, as a multiple of the stable-phase ``train.lr``."""
    shape: Annotated[str, OneOf(("cosine", "linear", "1sqrt"))] = "cosine"
    """Decay after the warmup, to ``min_lr_ratio`` x peak at the end: cosine, linear or 1sqrt."""
    min_lr_ratio: Annotated[float, Range(0, 1)] = 0.0
    """LR at the end of the continued training, as a fraction of the peak."""
    early_tokens: Annotated[Tokens, AT_LEAST_1] = 40_960
    """"Early" = the first this many tokens of the continued training (early loss, gradient-norm roughness)."""

    def __post_init__(self) -> None:
        from pmakit.weights import get_weights

        check_fields(self, "init")  # the bounds declared above
        if self.early_tokens > self.continue_tokens or self.warmup_tokens >= self.continue_tokens:
            raise PmakitError("init.early_tokens and init.warmup_tokens must be shorter than continue_tokens")
        get_weights(self.method, self.n)

    @property
    def merge_arm(self) -> str:
        return f"{self.method}{self.n}"


@dataclass
class ResolvedStudy:
    """A validated study config."""

    kind: str
    train: TrainConfig
    spec: SpikeStudyConfig | InitStudyConfig
    preset: str


def resolve(data: Mapping[str, Any]) -> ResolvedStudy:
    """The config ``data`` checked whole (``resolve_study``): what ``pmakit experiment`` validates first."""
    return resolve_study(data)


def resolve_study(data: Mapping[str, Any]) -> ResolvedStudy:
    """Validate a loaded config (``study: spike|init`` with ``train:`` and a section named after the study)."""
    kind = data.get("study")
    if kind not in STUDIES:
        raise PmakitError(f"unknown study {kind!r}; known: {', '.join(STUDIES)}")
    if data.get("experiment"):
        raise PmakitError(f"study {kind}: its knobs go in a `{kind}:` section, not `experiment:`")
    train = TrainConfig.from_dict(data.get("train", {}) or {})
    v = train.every_tokens
    # per-step records for the detector and the grad-norm curves; the loop's own online merge is not used
    train = replace(train, log_every=1, average_last=1, decay_tokens=0)
    section = data.get(kind, {}) or {}
    spec: SpikeStudyConfig | InitStudyConfig
    if kind == "spike":
        spec = from_mapping(SpikeStudyConfig, section, "spike")
        if spec.push_at % v or spec.push_at <= train.warmup_tokens:
            raise PmakitError(
                f"spike.push_at ({spec.push_at}) must be a multiple of every_tokens ({v}) after the warmup"
            )
        if spec.push_at - spec.last * v < v:
            raise PmakitError(f"spike.push_at leaves fewer than {spec.last} snapshots before the push")
        if spec.push_at + spec.push_tokens >= train.total_tokens:
            raise PmakitError("the push must end before train.total_tokens (the arms need room to train)")
        # Full states at every snapshot time from a few before the push to well after it: the resume point is
        # wherever the detector puts the spike.
        first = max(v, spec.push_at - (spec.last + 2) * v)
        last = min(train.total_tokens - v, spec.push_at + spec.push_tokens + 20 * v)
        train = replace(train, keep_checkpoints_at=tuple(range(first, last + 1, v)))
    else:
        spec = from_mapping(InitStudyConfig, section, "init")
        if spec.init_at % v or spec.init_at - (spec.n - 1) * v < v:
            raise PmakitError(
                f"init.init_at ({spec.init_at}) must be a multiple of every_tokens ({v}) with {spec.n} snapshots "
                "up to it"
            )
        if spec.init_at <= train.warmup_tokens:
            raise PmakitError("init.init_at must be after the warmup")
        train = replace(
            train,
            total_tokens=spec.init_at + spec.continue_tokens,
            keep_checkpoints_at=(spec.init_at,),
        )
    return ResolvedStudy(kind, train, spec, str(data.get("preset", "")))


# --------------------------------------------------------------------------------------------------- schedules


def push_schedule(train: TrainConfig, spec: SpikeStudyConfig) -> Callable[[float], float]:
    """The spike run's LR: the stable schedule, times ``push_factor`` on (push_at, push_at + push_tokens]."""
    base = train.schedule()
    lo, hi = spec.push_at, spec.push_at + spec.push_tokens

    def lr(tokens: float) -> float:
        return base(tokens) * (spec.push_factor if lo < tokens <= hi else 1.0)

    return lr


def resume_schedule(train: TrainConfig, spec: SpikeStudyConfig, start: int) -> Callable[[float], float]:
    """A resumed arm's LR after ``start``: the stable LR (or the pushed schedule) x ``resume_lr_factor``."""
    pushed = push_schedule(train, spec)
    base = train.schedule()

    def lr(tokens: float) -> float:
        if tokens <= start:
            return pushed(tokens)
        own = base(tokens) if spec.resume_lr == "base" else pushed(tokens)
        return own * spec.resume_lr_factor

    return lr


def continue_schedule(train: TrainConfig, spec: InitStudyConfig) -> Callable[[float], float]:
    """The init arms' LR: warmup from 0 to the peak, then decay to min_lr_ratio x peak at the end."""
    from pmakit.schedule import wsd_multiplier

    base = train.schedule()
    start, end = spec.init_at, spec.init_at + spec.continue_tokens
    peak = train.lr * spec.peak_lr_factor

    def lr(tokens: float) -> float:
        if tokens <= start:
            return base(tokens)
        t = tokens - start
        return peak * wsd_multiplier(
            t,
            warmup=spec.warmup_tokens,
            decay_start=spec.warmup_tokens,
            decay_end=spec.continue_tokens,
            shape=spec.shape,
            floor=spec.min_lr_ratio,
        )

    assert end > start
    return lr


def describe_resume_lr(train: TrainConfig, spec: SpikeStudyConfig) -> str:
    """The resumed arms' LR in words, for the results and the report."""
    factor = spec.resume_lr_factor
    if spec.resume_lr == "base":
        return f"stable-phase LR x {factor:g} = {train.lr * factor:.3g} (the push is over)"
    return f"the run's own schedule x {factor:g} (the rest of the push at {spec.push_factor:g}x included)"


# --------------------------------------------------------------------------------------------------- running


@dataclass
class _Ctx:
    """What every arm of a study shares."""

    study: ResolvedStudy
    run_dir: Path
    corpus: Any
    progress: bool
    results: ResultRows
    scorer: SplitScorer

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self.results.rows

    def done(self, seed: int, stage: str, model: str) -> dict[str, Any] | None:
        return next(
            (r for r in self.rows if (r["seed"], r["stage"], r["model"]) == (seed, stage, model)), None
        )

    def result(self, row: Mapping[str, Any]) -> EvalResult:
        return EvalResult(row["val_loss"], row["val_loss_se"], row["bpb"], row["batch_losses"])

    def append(self, row: dict[str, Any]) -> None:
        self.results.add({**{c: None for c in STUDY_COLUMNS}, "study": self.study.kind, **row})
        write_csv(self.run_dir / RESULTS_CSV, STUDY_COLUMNS, self.rows)


def run_study(
    data: Mapping[str, Any], run_dir: str | Path, *, fresh: bool = False, progress: bool = True
) -> Path:
    """Run (or resume) a spike or init study into ``run_dir``; returns the report's path."""
    from pmakit.train.data import val_batches
    from pmakit.train.loop import load_corpus

    study = resolve_study(data)
    run = open_run(run_dir, _config_record(study), fresh=fresh, grows=(study.kind, "seeds"), indent=2)
    run_dir, started = run.dir, run.started
    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    load0 = os.getloadavg()
    cfg = study.train
    # One corpus (and so one held-out set) for every seed: the seed changes only the init and the data order.
    corpus = load_corpus(cfg)
    batches = val_batches(
        corpus.val, batch_size=cfg.batch_size, seq_len=cfg.model.seq_len, max_batches=cfg.eval_batches
    )
    scorer = SplitScorer.build(
        cfg.model, corpus, {"val": batches}
    )  # the batches every Trainer of the study uses
    ctx = _Ctx(study, run_dir, corpus, progress, ResultRows(run_dir / RESULTS, _row_key), scorer)
    per_seed: dict[str, Any] = {}
    for seed in study.spec.seeds:
        if study.kind == "spike":
            per_seed[str(seed)] = _spike_seed(ctx, seed)
        else:
            per_seed[str(seed)] = _init_seed(ctx, seed)
    seconds = time.perf_counter() - t0
    _write_curves(ctx)
    _write_experiment_json(ctx, per_seed, started, seconds, _cpu_seconds() - cpu0, load0)
    from pmakit.report import write_report

    paths = write_report(run_dir)
    return Path(getattr(paths, "html", run_dir / "report.html"))


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (to extrapolate to an idle machine)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _seed_config(ctx: _Ctx, seed: int) -> TrainConfig:
    return replace(ctx.study.train, seed=seed)


def _train_run(ctx: _Ctx, seed: int, schedule: Callable[[float], float]) -> Trainer:
    """The seed's main run (resumed if it exists); returned open, trained to its end."""
    cfg = _seed_config(ctx, seed)
    run = ctx.run_dir / f"seed-{seed}" / "run"
    trainer = Trainer(cfg, run, corpus=ctx.corpus, schedule=schedule, progress=ctx.progress)
    if trainer.tokens < cfg.total_tokens:
        log.info("seed %d: main run to %s tokens", seed, format_tokens(cfg.total_tokens))
    trainer.fit()
    trainer.saver.wait()
    return trainer


def _fork_arm(
    ctx: _Ctx,
    seed: int,
    arm: str,
    checkpoint: Path,
    schedule: Callable[[float], float],
    state: Mapping[str, torch.Tensor],
    optimizer: str,
    reason: dict[str, Any],
) -> Trainer:
    """An arm forked from ``checkpoint`` with weights ``state``; resumes its own checkpoint when there is one."""
    cfg = replace(_seed_config(ctx, seed), keep_checkpoints_at=())
    arm_dir = ctx.run_dir / f"seed-{seed}" / arm.replace("/", "-")
    own = checkpoint_dir(arm_dir)
    fresh = not trainer_state(own).exists()
    trainer = Trainer(
        cfg,
        arm_dir,
        corpus=ctx.corpus,
        schedule=schedule,
        resume_from=checkpoint if fresh else None,
        progress=ctx.progress,
    )
    if fresh:
        trainer.rollback(state, optimizer=optimizer, reason=reason)
        trainer.evaluate_now()  # the curve starts at the arm's starting weights
    return trainer


def _finish(trainer: Trainer) -> EvalResult:
    try:
        trainer.fit()
        return trainer.score()
    finally:
        trainer.close()


def _load(directory: Path) -> dict[str, torch.Tensor]:
    from pmakit.formats import read_state

    return read_state(directory)


# ------------------------------------------------------------------------------------------------- spike study


def _spike_seed(ctx: _Ctx, seed: int) -> dict[str, Any]:
    """Train the pushed run, find its spike, train every arm from the chosen snapshots; returns the seed's record."""
    from pmakit.recover import choose_rollback, loss_lag_tokens, merged_state, spike_boundary
    from pmakit.snapshot import discover

    spec = ctx.study.spec
    assert isinstance(spec, SpikeStudyConfig)
    cfg = _seed_config(ctx, seed)
    run = _no_intervention(ctx, seed, cfg, spec)
    records, spikes, info = _detect_spikes(run, cfg, spec)
    chosen_spike = next((s for s in spikes if s.start_tokens > spec.push_at), None)
    if chosen_spike is None:
        info["error"] = "no spike detected at or after the push: no arms were trained"
        log.warning(
            "seed %d: the detector found no spike after the push (%d spikes before it)", seed, len(spikes)
        )
        return info
    lag = loss_lag_tokens(records)
    boundary = spike_boundary(chosen_spike, lag)
    chosen = choose_rollback(discover(snapshots_dir(run)), boundary, spec.last)
    start = chosen[-1].tokens
    checkpoint = kept_checkpoint_dir(run, start)
    if not trainer_state(checkpoint).exists():
        raise PmakitError(
            f"no full checkpoint at {format_tokens(start)} tokens in {checkpoint.parent}: the spike started "
            "outside the range kept around the push; move spike.push_at or lengthen the run"
        )
    sma_state, weights = merged_state(chosen, spec.method, 0.2)
    info.update(
        spike=chosen_spike.to_dict(),
        spike_text=chosen_spike.describe(),
        false_alarms=sum(1 for s in spikes if s.start_tokens <= spec.push_at),
        loss_lag_tokens=lag,
        boundary_tokens=boundary,
        merged=[{"tokens": s.tokens, "step": s.step, "weight": w} for s, w in zip(chosen, weights)],
        resume_tokens=start,
        optimizer_from_tokens=start,
        resume_lr=describe_resume_lr(cfg, spec),
    )
    states = {"latest": _load(chosen[-1].path), spec.merge_arm: sma_state}
    _score_starts(ctx, seed, spec, chosen, states)
    _train_arms(ctx, seed, cfg, spec, chosen, states, checkpoint, info)
    return info


def _no_intervention(ctx: _Ctx, seed: int, cfg: TrainConfig, spec: SpikeStudyConfig) -> Path:
    """Train (or resume) the pushed run and score it as the no-intervention arm; returns its run directory."""
    trainer = _train_run(ctx, seed, push_schedule(cfg, spec))
    try:
        if ctx.done(seed, "final", NO_INTERVENTION) is None:
            result = trainer.score()
            ctx.append(
                {
                    "seed": seed,
                    "stage": "final",
                    "model": NO_INTERVENTION,
                    "tokens": trainer.tokens,
                    "start_tokens": 0,
                    "resume_lr": f"the pushed run: {spec.push_factor:g}x LR for {format_tokens(spec.push_tokens)}"
                    f" tokens from {format_tokens(spec.push_at)}, then the stable LR",
                    **_scores(result),
                    "delta_vs_control": 0.0,
                    "delta_control_se": 0.0,
                    "label": f"no intervention (seed {seed})",
                }
            )
    finally:
        trainer.close()
    return trainer.run_dir


def _detect_spikes(
    run: Path, cfg: TrainConfig, spec: SpikeStudyConfig
) -> tuple[list[dict[str, Any]], list[Any], dict[str, Any]]:
    """The pushed run's per-step training records, the spikes the detector finds in them, the seed's record."""
    from pmakit.metrics import read_metrics
    from pmakit.recover import find_spikes

    records = [r for r in read_metrics(run) if r.get("kind") == "train"]
    records = list({r["step"]: r for r in records}.values())  # a resumed run may log a step twice
    records.sort(key=lambda r: r["step"])
    detector = spec.spike_config(cfg.warmup_tokens)
    spikes = find_spikes(records, detector)
    info: dict[str, Any] = {
        "spikes": [s.to_dict() for s in spikes],
        "detector": jsonable(asdict(detector)),
        "push": {"at": spec.push_at, "tokens": spec.push_tokens, "factor": spec.push_factor},
    }
    return records, spikes, info


def _score_starts(
    ctx: _Ctx, seed: int, spec: SpikeStudyConfig, chosen: list[Any], states: dict[str, Any]
) -> None:
    """The starting weights of the two families, before any training (same batches, paired)."""
    start = chosen[-1].tokens
    for name, state in states.items():
        if ctx.done(seed, "start", name) is None:
            res = ctx.scorer(state, "val")
            ctx.append(
                {
                    "seed": seed,
                    "stage": "start",
                    "model": name,
                    **_weights_of(name, spec, chosen),
                    "tokens": start,
                    "start_tokens": start,
                    **_scores(res),
                    "label": f"{name} weights at the resume point ({format_tokens(start)})",
                }
            )
    _paired_start(ctx, seed, spec.merge_arm)


def _train_arms(
    ctx: _Ctx,
    seed: int,
    cfg: TrainConfig,
    spec: SpikeStudyConfig,
    chosen: list[Any],
    states: dict[str, Any],
    checkpoint: Path,
    info: dict[str, Any],
) -> None:
    """Each family (latest, merge) x each optimizer policy, resumed at the newest chosen snapshot and scored."""
    sma, start = spec.merge_arm, chosen[-1].tokens
    schedule = resume_schedule(cfg, spec, start)
    for opt in spec.optimizers:
        for family, state in states.items():
            arm = f"{family}/{opt}"
            if ctx.done(seed, "final", arm) is not None:
                continue
            log.info("seed %d: arm %s from %s tokens", seed, arm, format_tokens(start))
            reason = {
                "arm": arm,
                "spike": info["spike"],
                "merged": info["merged"] if family == sma else [{"tokens": start, "weight": 1.0}],
            }
            # keep: the optimizer state loaded with the checkpoint at the resume point is kept as it is.
            result = _finish(_fork_arm(ctx, seed, arm, checkpoint, schedule, state, opt, reason))
            ctx.append(
                {
                    "seed": seed,
                    "stage": "final",
                    "model": arm,
                    **_weights_of(family, spec, chosen),
                    "optimizer": opt,
                    "resume_lr": info["resume_lr"],
                    "start_tokens": start,
                    "tokens": cfg.total_tokens,
                    **_scores(result),
                    "label": f"{'latest snapshot' if family == 'latest' else f'{spec.method.upper()} of {len(chosen)}'}"
                    f", optimizer {opt} (seed {seed})",
                }
            )
    _paired_final(ctx, seed, sma, spec.optimizers)


def _weights_of(family: str, spec: SpikeStudyConfig, chosen: list[Any]) -> dict[str, Any]:
    """A row's fields for the weights a family starts from: the newest chosen snapshot, or the merge of them all."""
    latest = family == "latest"
    return {
        "method": "latest" if latest else spec.method,
        "n": 1 if latest else len(chosen),
        "window_start_tokens": chosen[-1 if latest else 0].tokens,
    }


def _scores(result: EvalResult) -> dict[str, Any]:
    return {
        "val_loss": result.loss,
        "val_loss_se": result.loss_se,
        "bpb": result.bpb,
        "batch_losses": result.batch_losses,
    }


def _set_delta(ctx: _Ctx, row: dict[str, Any], key: str, se_key: str, ref: Mapping[str, Any] | None) -> bool:
    if ref is None or row.get(key) is not None:
        return False
    d, se = paired_difference(ctx.result(row), ctx.result(ref))
    row[key], row[se_key] = d, se
    return True


def _pair_with_latest(ctx: _Ctx, latest: dict[str, Any] | None, merged: dict[str, Any] | None) -> bool:
    """The latest row's delta (0), and the merged row's paired with it over the same batches; True if either was
    new."""
    changed = False
    if latest is not None and latest.get("delta_vs_latest") is None:
        latest["delta_vs_latest"], latest["delta_se"] = 0.0, 0.0
        changed = True
    if merged is not None:
        changed |= _set_delta(ctx, merged, "delta_vs_latest", "delta_se", latest)
    return changed


def _paired_start(ctx: _Ctx, seed: int, sma: str) -> None:
    if _pair_with_latest(ctx, ctx.done(seed, "start", "latest"), ctx.done(seed, "start", sma)):
        _rewrite(ctx)


def _paired_final(ctx: _Ctx, seed: int, sma: str, optimizers: Sequence[str]) -> None:
    control = ctx.done(seed, "final", NO_INTERVENTION)
    changed = False
    for opt in optimizers:
        latest = ctx.done(seed, "final", f"latest/{opt}")
        merged = ctx.done(seed, "final", f"{sma}/{opt}")
        changed |= _pair_with_latest(ctx, latest, merged)
        for row in (latest, merged):
            if row is not None:
                changed |= _set_delta(ctx, row, "delta_vs_control", "delta_control_se", control)
    if changed:
        _rewrite(ctx)


def _rewrite(ctx: _Ctx) -> None:
    atomic_write_text(ctx.run_dir / RESULTS, "".join(json.dumps(r) + "\n" for r in ctx.rows))
    write_csv(ctx.run_dir / RESULTS_CSV, STUDY_COLUMNS, ctx.rows)


# -------------------------------------------------------------------------------------------------- init study


def _init_seed(ctx: _Ctx, seed: int) -> dict[str, Any]:
    """The constant-LR run to init_at, then continued training from the latest snapshot and from the merge."""
    from pmakit.snapshot import discover
    from pmakit.weights import get_weights

    spec = ctx.study.spec
    assert isinstance(spec, InitStudyConfig)
    cfg = _seed_config(ctx, seed)
    run_cfg = replace(cfg, total_tokens=spec.init_at)
    run = ctx.run_dir / f"seed-{seed}" / "run"
    _train_to_init(ctx, run_cfg, run)
    snaps = {s.tokens: s for s in discover(snapshots_dir(run))}
    v = cfg.every_tokens
    window = [snaps[spec.init_at - k * v] for k in range(spec.n)][::-1]
    weights = get_weights(spec.method, spec.n)
    latest_state = _load(window[-1].path)
    merged = average_states([_load(s.path) for s in window], weights)
    checkpoint = kept_checkpoint_dir(run, spec.init_at)
    schedule = continue_schedule(cfg, spec)
    sma = spec.merge_arm
    info = {
        "init_at": spec.init_at,
        "merged": [{"tokens": s.tokens, "step": s.step, "weight": w} for s, w in zip(window, weights)],
        "schedule": f"linear warmup over {format_tokens(spec.warmup_tokens)} tokens to {cfg.lr * spec.peak_lr_factor:.3g}"
        f", then {spec.shape} decay to {spec.min_lr_ratio:g} x peak at {format_tokens(cfg.total_tokens)}",
    }
    for arm, state in (("latest", latest_state), (sma, merged)):
        if ctx.done(seed, "final", arm) is not None:
            continue
        log.info("seed %d: continued training from %s", seed, arm)
        _continue_init_arm(ctx, seed, arm, state, window, info, checkpoint, schedule)
    _paired_init(ctx, seed, sma)
    return info


def _train_to_init(ctx: _Ctx, run_cfg: TrainConfig, run: Path) -> None:
    """The constant-LR base run of one seed, to ``init_at``; its snapshots are written before it returns."""
    trainer = Trainer(run_cfg, run, corpus=ctx.corpus, progress=ctx.progress)
    try:
        trainer.fit()
        trainer.saver.wait()
    finally:
        trainer.close()


def _continue_init_arm(
    ctx: _Ctx,
    seed: int,
    arm: str,
    state: dict[str, torch.Tensor],
    window: list[Snapshot],
    info: dict[str, Any],
    checkpoint: Path,
    schedule: Callable[[float], float],
) -> None:
    """Continued training of one init-study arm from ``state``: its start, early and final rows."""
    spec = ctx.study.spec
    assert isinstance(spec, InitStudyConfig)
    cfg = _seed_config(ctx, seed)
    tr = _fork_arm(
        ctx, seed, arm, checkpoint, schedule, state, "reset", {"arm": arm, "merged": info["merged"]}
    )
    common = {
        "seed": seed,
        "model": arm,
        "method": "latest" if arm == "latest" else spec.method,
        "n": 1 if arm == "latest" else spec.n,
        "optimizer": "reset",
        "resume_lr": info["schedule"],
        "start_tokens": spec.init_at,
        "window_start_tokens": window[-1].tokens if arm == "latest" else window[0].tokens,
    }
    try:
        if ctx.done(seed, "start", arm) is None:
            ctx.append({**common, "stage": "start", "tokens": spec.init_at, **_scores(ctx.scorer(state, "val")),
                        "label": f"{arm} weights before continued training (seed {seed})"})  # fmt: skip
        early_end = spec.init_at + spec.early_tokens
        if ctx.done(seed, "early", arm) is None:
            if tr.tokens > early_end:
                raise PmakitError(f"{tr.run_dir}: resumed past the early point; rerun with --fresh")
            tr.fit(until_tokens=early_end)
            ctx.append({**common, "stage": "early", "tokens": tr.tokens, **_scores(tr.score()),
                        **_grad_stats(tr.run_dir, spec.init_at, early_end),
                        "label": f"{arm} after {format_tokens(spec.early_tokens)} tokens (seed {seed})"})  # fmt: skip
        tr.fit()
        ctx.append({**common, "stage": "final", "tokens": tr.tokens, **_scores(tr.score()),
                    **_grad_stats(tr.run_dir, spec.init_at, cfg.total_tokens),
                    "label": f"{arm} at the end of continued training (seed {seed})"})  # fmt: skip
    finally:
        tr.close()


def _paired_init(ctx: _Ctx, seed: int, sma: str) -> None:
    """Each stage's merged row paired with the latest row of the same seed (deltas over the same batches)."""
    for stage in ("start", "early", "final"):
        if _pair_with_latest(ctx, ctx.done(seed, stage, "latest"), ctx.done(seed, stage, sma)):
            _rewrite(ctx)


def _grad_stats(run_dir: Path, lo: int, hi: int) -> dict[str, float | None]:
    """Gradient norm of the steps in (lo, hi]: mean, max and mean absolute step-to-step change."""
    from pmakit.metrics import read_metrics

    by_step = {
        r["step"]: r
        for r in read_metrics(run_dir)
        if r.get("kind") == "train" and lo < r["tokens"] <= hi and r.get("grad_norm") is not None
    }
    g = [float(by_step[s]["grad_norm"]) for s in sorted(by_step)]
    g = [x for x in g if math.isfinite(x)]
    if not g:
        return {"grad_norm_mean": None, "grad_norm_max": None, "grad_norm_tv": None}
    tv = sum(abs(b - a) for a, b in zip(g, g[1:])) / max(1, len(g) - 1)
    return {"grad_norm_mean": sum(g) / len(g), "grad_norm_max": max(g), "grad_norm_tv": tv}


# ------------------------------------------------------------------------------------------------------ outputs


def _arm_dirs(ctx: _Ctx) -> list[tuple[str, int, Path]]:
    out = []
    for seed in ctx.study.spec.seeds:
        base = ctx.run_dir / f"seed-{seed}"
        main = NO_INTERVENTION if ctx.study.kind == "spike" else "run"
        out.append((main, seed, base / "run"))
        for r in ctx.rows:
            if r["seed"] == seed and r["stage"] == "final" and r["model"] != NO_INTERVENTION:
                out.append((r["model"], seed, base / r["model"].replace("/", "-")))
    return out


def _write_curves(ctx: _Ctx) -> None:
    """curves.csv (held-out loss of every arm and seed) and train_curves.csv (per-step loss, grad norm, LR)."""
    from pmakit.metrics import read_metrics

    curves: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    for arm, seed, d in _arm_dirs(ctx):
        seen: set[int] = set()
        seen_steps: set[int] = set()
        for r in read_metrics(d):
            if r.get("kind") == "eval" and r.get("model") == "latest" and r["tokens"] not in seen:
                seen.add(r["tokens"])
                curves.append({"series": f"{arm}@seed{seed}", "tokens": r["tokens"], "val_loss": r["val_loss"],
                               "val_loss_se": r["val_loss_se"], "arm": arm, "seed": seed})  # fmt: skip
            elif r.get("kind") == "train" and r["step"] not in seen_steps:
                seen_steps.add(r["step"])
                steps.append({"arm": arm, "seed": seed, "step": r["step"], "tokens": r["tokens"],
                              "loss": r["loss"], "grad_norm": r.get("grad_norm"), "lr": r.get("lr")})  # fmt: skip
    curves.sort(key=lambda r: (r["seed"], r["arm"], r["tokens"]))
    steps.sort(key=lambda r: (r["seed"], r["arm"], r["step"]))
    write_csv(ctx.run_dir / "curves.csv", CURVE_COLUMNS, curves)
    write_csv(ctx.run_dir / "train_curves.csv", TRAIN_CURVE_COLUMNS, steps)


def _config_record(study: ResolvedStudy) -> dict[str, Any]:
    return {"train": jsonable(study.train.to_dict()), study.kind: jsonable(asdict(study.spec))}


def _row_key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a result row measured: one seed's stage of one arm."""
    return row["seed"], row["stage"], row["model"]


def _write_experiment_json(
    ctx: _Ctx,
    per_seed: dict[str, Any],
    started: str,
    seconds: float,
    cpu_seconds: float,
    load_before: tuple[float, float, float],
) -> None:
    from pmakit.train.model import count_parameters

    path = ctx.run_dir / "experiment.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    study = ctx.study
    record = {
        "study": study.kind,
        "preset": study.preset,
        "config": _config_record(study),
        "started": previous.get("started", started),
        "finished": utc_now(),
        "seconds": {"total": round(seconds, 1), "cpu": round(cpu_seconds, 1)},
        # every invocation (a resumed or extended study adds one), so that the whole cost stays traceable
        "invocations": [
            *previous.get("invocations", []),
            {
                "finished": utc_now(),
                "seconds": round(seconds, 1),
                "cpu_seconds": round(cpu_seconds, 1),
                "seeds": list(study.spec.seeds),
                "load_average_before": [round(x, 2) for x in load_before],
                "load_average_after": [round(x, 2) for x in os.getloadavg()],
            },
        ],
        "load_average": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in os.getloadavg()],
        },
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "model": {
            "parameters": count_parameters(ctx.scorer.model),
            "layers": study.train.model.layers,
            "hidden": study.train.model.hidden,
            "vocab_size": ctx.corpus.vocab_size,
            "seq_len": study.train.model.seq_len,
        },
        "corpus": jsonable(ctx.corpus.files),
        "base_every_tokens": study.train.every_tokens,
        "tokens_per_step": study.train.tokens_per_step,
        "eval_batches": len(ctx.scorer.batches["val"]),
        "seeds": per_seed,
        "pmakit_version": pmakit.__version__,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if study.kind == "spike":
        assert isinstance(study.spec, SpikeStudyConfig)
        record["resume_lr"] = describe_resume_lr(study.train, study.spec)
    path.write_text(json.dumps(jsonable(record), indent=2) + "\n")
