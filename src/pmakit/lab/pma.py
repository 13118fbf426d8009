"""``pmakit experiment``: the paper's central comparison at CPU size, from one config.

1. Train one run at constant LR after warmup (the WSD "stable" phase), saving a snapshot every V tokens and a
   full state at each fork point F.
2. At each fork, an anneal branch: the same run continued for D tokens with the LR decayed to 0 (the thing PMA
   predicts without paying for it). The constant-LR run continues over the same D tokens.
3. At each fork's end E = F + D, evaluate on the SELECTION split of the held-out files: the latest snapshot, the
   anneal, and merges of snapshots ending at E over a grid of N (count), V (spacing) and weightings (descriptive
   tables). Also latest vs SMA at a few points of the stable phase.
4. The headline, on the disjoint TEST split (other held-out files, ``pmakit.train.data.heldout_splits``): the latest
   snapshot, the anneal, the best merge and the best SMA (both chosen on the selection split), the fixed recipe
   (SMA of the last 10 snapshots at the configured V: no selection at all) and, with ``tune_evals``, the merge
   ``pmakit tune``'s search picks on the selection split. Every headline number has a paired s.e. on the test split.
5. Write results.csv/jsonl, curves.csv, experiment.json, the merged model of the headline comparison (written by
   the real ``pmakit merge`` engine, so it loads with ``from_pretrained``) and the report.

Re-running into the same directory resumes: finished training and finished evaluations are not redone.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import torch

import pmakit
from pmakit.config import (
    AT_LEAST_1,
    AT_LEAST_2,
    NON_NEGATIVE,
    Length,
    OneOf,
    Range,
    Tokens,
    check_fields,
    from_mapping,
)
from pmakit.errors import PmakitError
from pmakit.evaluate import EvalResult, paired_difference
from pmakit.formats import read_state
from pmakit.lab.context import StudyProgress, StudyRun, check_same_config, jsonable, open_run, utc_now
from pmakit.lab.results import ResultRows, write_csv
from pmakit.lab.scoring import SplitScorer
from pmakit.lab.trunk import anneal_fork, log_phase
from pmakit.merge import average_states
from pmakit.report.schema import PMA_COLUMNS
from pmakit.runs import (
    MAIN_RUN,
    RESULTS,
    RESULTS_CSV,
    anneal_run,
    checkpoint_dir,
    read_jsonl,
    run_relative,
    snapshots_dir,
)
from pmakit.schedule import DECAY_SHAPES
from pmakit.snapshot import Snapshot, discover
from pmakit.train.loop import TrainConfig, Trainer
from pmakit.units import format_tokens
from pmakit.weights import get_weights, uses_alpha

if TYPE_CHECKING:
    from pmakit.lab.tune import Candidate, Scorer, Space

FIXED_N = 10
"""N of the fixed recipe row (the paper's default SMA at the configured V): no selection at all."""

# The study's progress line: each stage's work in trained-token equivalents (``StudyProgress``). What one token costs
# beside a token trained, measured on the demo (an idle 2-core machine: training 11.3K tokens/s, the loss plane's
# forward passes 49K held-out tokens/s, the tuner's learned-weights fit ~10K tokens/s, lm-eval 12.9 s per model).
EVAL_COST = 0.23
"""A held-out token scored (forward only)."""
LEARN_COST = 1.0
"""A token of the tuner's learned-weights fit (forward and backward through the merge)."""
TUNE_SHARE = 0.3
"""The share of its trials' selection batches the tuner scores (a trial clearly worse than the best stops early)."""
DOWNSTREAM_BATCHES = 6.4
"""One model's downstream tasks, in held-out batches' tokens scored (``eval_batches`` of them: 6.4x as many)."""
DOWNSTREAM_MODELS = 8
"""Models scored downstream at the final fork (its headline models and the raw snapshots of the noise band)."""

log = logging.getLogger(__name__)

RESULT_COLUMNS = PMA_COLUMNS


@dataclass(frozen=True)
class ExperimentConfig:
    """The study on top of a training run (the ``experiment:`` section of a config)."""

    forks: Annotated[tuple[Annotated[Tokens, AT_LEAST_1], ...], Length(1)] = (4_000_000, 6_500_000)
    """Fork points F (tokens) where an anneal branch starts."""
    anneal_fraction: Annotated[float, Range(0, 1, lo_open=True)] = 0.2
    """Anneal length D as a fraction of F (rounded to whole snapshot intervals)."""
    anneal_shape: Annotated[str, OneOf(DECAY_SHAPES)] = "linear"
    """Decay shape of the anneal branches: linear, cosine or 1sqrt."""
    ns: Annotated[tuple[Annotated[int, AT_LEAST_1], ...], Length(1)] = (2, 4, 8, 16)
    """Numbers of snapshots N merged."""
    v_multiples: Annotated[tuple[Annotated[int, AT_LEAST_1], ...], Length(1)] = (1, 2, 4)
    """Merge spacings V, as multiples of the snapshot interval."""
    methods: Annotated[tuple[str, ...], Length(1)] = ("sma", "wma", "ema", "ema-normalized", "wsm-1sqrt")
    """Weightings compared at N = method_n, V = 1x."""
    alphas: Annotated[tuple[Annotated[float, Range(0, 1, lo_open=True)], ...], Length(1)] = (0.1, 0.2)
    """EMA factors tried for the ema weightings."""
    method_n: Annotated[int, AT_LEAST_2] = 8
    """N at which the weightings are compared."""
    points: Annotated[int, NON_NEGATIVE] = 6
    """Extra points of the stable phase where latest vs SMA(method_n) is evaluated (paper E1)."""
    eval_batches: Annotated[int, AT_LEAST_2] = 32
    """Held-out batches per split: the grid is scored on the selection split, the headline on the test split."""
    tune_evals: Annotated[int, Range(2, off=0)] = 0
    """Trials of ``pmakit tune``'s search (selection split) for a tuned merge at each fork (0: none)."""
    tune_learn_steps: Annotated[int, NON_NEGATIVE] = 20
    """Steps of the tuner's learned weights over its best window (``pmakit.lab.tune.learn_weights``; 0: none)."""
    plane_grid: Annotated[int, Range(2, off=0)] = 0
    """Loss plane (E11, E12) at the final fork for the best SMA window: grid points per axis (0: skip it)."""
    plane_batches: Annotated[int, AT_LEAST_1] = 4
    """Held-out batches per evaluation of the loss plane."""
    oracle: bool = False
    """Also score every SMA cell of the grid on the test split (role ``oracle``): the best that a choice made on
    the test split itself could reach, for scale only. Nothing is chosen from these rows; the report says how far
    the selection's pick is from them."""
    downstream: bool = True
    """Score the headline models at the final fork (and the raw snapshots just before the latest, for the noise band)
    on pmakit's offline lm-eval tasks, test items only (``pmakit.lab.downstream``): the report's downstream table."""
    compile_eval: Annotated[str, OneOf(("off", "on", "auto"))] = "off"
    """Score the grid, the tuner's trials, the headline and the loss plane through ``torch.compile``: ``off``,
    ``on``, or ``auto`` (on where it can build kernels: a C++ compiler on CPU). Compiling once costs ~20 s and makes
    each held-out batch ~0.8x as long: it pays for the hundreds of evaluations of the demo, not for a smoke run."""

    def __post_init__(self) -> None:
        check_fields(self, "experiment")  # the bounds declared above
        for m in self.methods:
            get_weights(m, 2)  # an unknown name fails here, listing the known ones

    @property
    def compiled(self) -> bool:
        """Whether the evaluations run through ``torch.compile`` here (``compile_eval`` resolved)."""
        from pmakit.evaluate import can_compile

        return self.compile_eval == "on" or (self.compile_eval == "auto" and can_compile())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExperimentConfig:
        return from_mapping(cls, data, "experiment")


@dataclass(frozen=True)
class Fork:
    fork_tokens: int
    anneal_tokens: int

    @property
    def eval_tokens(self) -> int:
        return self.fork_tokens + self.anneal_tokens


@dataclass
class Study:
    """A resolved experiment: configs with fork points aligned to the snapshot grid."""

    train: TrainConfig
    exp: ExperimentConfig
    forks: list[Fork]
    preset: str
    raw: dict[str, Any] = field(default_factory=dict)


def resolve(data: Mapping[str, Any]) -> Study:
    """Validate a loaded config and align forks and anneal lengths to whole snapshot intervals."""
    exp = ExperimentConfig.from_dict(data.get("experiment", {}) or {})
    train = TrainConfig.from_dict(data.get("train", {}) or {})
    v = train.every_tokens
    forks = []
    for f in sorted(set(exp.forks)):
        fork = max(v, round(f / v) * v)
        anneal = max(v, round(exp.anneal_fraction * fork / v) * v)
        if fork <= train.warmup_tokens:
            raise PmakitError(
                f"fork point {format_tokens(f)} is inside the warmup ({format_tokens(train.warmup_tokens)})"
            )
        forks.append(Fork(fork, anneal))
    total = max(f.eval_tokens for f in forks)
    if total > train.total_tokens:
        # The study trains to the last fork's end; past the config's own length it is a typo (forks: [1e9] with
        # total_tokens: 8192 was a silent 13-hour run), never a wish.
        last = forks[-1]
        raise PmakitError(
            f"experiment.forks: the last fork ({format_tokens(last.fork_tokens)}) and its anneal end at "
            f"{format_tokens(total)} tokens, beyond train.total_tokens ({format_tokens(train.total_tokens)}); "
            "raise train.total_tokens to train that long"
        )
    # The constant-LR run goes exactly to the last fork's end; fork states are kept for the anneal branches.
    train = replace(
        train, total_tokens=total, decay_tokens=0, keep_checkpoints_at=tuple(f.fork_tokens for f in forks)
    )
    return Study(train, exp, forks, str(data.get("preset", "")), dict(data))


# ---------------------------------------------------------------------------------------------------------------
# Running


def run_study(
    data: Mapping[str, Any], run_dir: str | Path, *, fresh: bool = False, progress: bool = True
) -> Path:
    """Run (or resume) the PMA study into ``run_dir``; returns the report's path."""
    from pmakit.train.loop import load_corpus

    study = resolve(data)
    run = open_run(run_dir, _config_stamp(study), fresh=fresh, **_stamp_rules())
    run_dir = run.dir
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    cfg = study.train
    corpus = load_corpus(cfg)
    seconds["corpus"] = time.perf_counter() - t

    t = time.perf_counter()
    main = Trainer(
        cfg,
        run_dir / MAIN_RUN,
        corpus=corpus,
        progress=progress,
        progress_note=lambda n: meter.at("train", n),
    )
    meter = StudyProgress(_work(study, main.tokens, run_dir))
    model = main.describe()
    log_phase(
        f"constant-LR run to {format_tokens(cfg.total_tokens)} tokens "
        f"({model['parameters'] / 1e6:.2f}M parameters, {model['precision']})",
        main.tokens,
        cfg.total_tokens,
    )
    main.fit()
    main.saver.wait()
    meter.end("train")
    seconds["train"] = time.perf_counter() - t

    t = time.perf_counter()
    for fork in study.forks:
        before = meter.done.get("anneal", 0.0)

        def note(n: int, before: float = before) -> str:
            return meter.at("anneal", before + n)

        anneal_fork(cfg, study.exp.anneal_shape, fork.fork_tokens, fork.anneal_tokens, run_dir, run_dir / MAIN_RUN,
                    corpus, progress, note)  # fmt: skip
    meter.end("anneal")
    seconds["anneal"] = time.perf_counter() - t

    grid, heldout = _evaluate(study, run_dir, main, corpus, progress, seconds, meter)
    if study.exp.downstream:
        from pmakit.lab.downstream import run_downstream

        t = time.perf_counter()
        log.info("downstream tasks: the headline models on lm-eval, test items; %s", meter.note())
        run_downstream(grid, run_dir, Path(corpus.files["cache"]), meter, _downstream_units(study))
        seconds["downstream"] = time.perf_counter() - t
    main.close()

    _write_curves(run_dir, study)
    headline = grid.write_headline_merge()
    seconds["total"] = sum(seconds.values())
    _write_experiment_json(run, study, main, corpus, seconds, headline, heldout)
    from pmakit.report import write_report

    paths = write_report(run_dir)
    return Path(getattr(paths, "html", run_dir / "report.html"))


def _work(study: Study, trained: int, run_dir: Path) -> dict[str, float]:
    """Each stage's work left, in trained-token equivalents (the progress line's estimate; a stage that starts
    states its exact size)."""
    from pmakit.lab.results import trained_tokens

    exp, cfg = study.exp, study.train
    scored = _scored_units(study, exp.eval_batches)  # one model on one split
    anneal = 0
    for fork in study.forks:
        branch = anneal_run(run_dir, fork.fork_tokens)
        anneal += fork.eval_tokens - max(fork.fork_tokens, trained_tokens(branch) if branch.exists() else 0)
    forks = len(study.forks)
    plane = (
        0 if (run_dir / "plane.json").exists() else (exp.plane_grid**2 + 3 * max(exp.ns)) * exp.plane_batches
    )
    return {
        "train": cfg.total_tokens - trained,
        "anneal": anneal,
        "selection": len(_Grid.plan_of(study)) * scored,
        "test": forks * (6 * scored + _tune_units(study, exp.eval_batches)),
        "plane": _scored_units(study, plane),
        "downstream": DOWNSTREAM_MODELS * _downstream_units(study) if exp.downstream else 0,
    }


def _scored_units(study: Study, batches: float) -> float:
    """``batches`` held-out batches scored (forward only), in trained-token equivalents."""
    return batches * study.train.tokens_per_step * EVAL_COST


def _tune_units(study: Study, selection_batches: int) -> float:
    """The tuner's search and learned-weights fit at one fork (0 without a tuner), in trained-token equivalents."""
    from pmakit.lab.tune import LEARN_BATCHES

    exp = study.exp
    if not exp.tune_evals:
        return 0.0
    learn = exp.tune_learn_steps * LEARN_BATCHES * study.train.tokens_per_step * LEARN_COST
    return exp.tune_evals * TUNE_SHARE * _scored_units(study, selection_batches) + learn


def _downstream_units(study: Study) -> float:
    """One model's downstream tasks, in trained-token equivalents."""
    return _scored_units(study, DOWNSTREAM_BATCHES * study.exp.eval_batches)


def _evaluate(
    study: Study,
    run_dir: Path,
    main: Trainer,
    corpus: Any,
    progress: bool,
    seconds: dict[str, float],
    meter: StudyProgress,
) -> tuple[_Grid, dict[str, Any]]:
    """The grid on the selection split, the headline on the test split, then the plane and the spectrum."""
    from pmakit.lab.spectrum import experiment_spectrum
    from pmakit.train.data import corpus_heldout, split_batches

    cfg = study.train
    t = time.perf_counter()
    held = corpus_heldout(corpus)
    batches = split_batches(
        held, batch_size=cfg.batch_size, seq_len=cfg.model.seq_len, max_batches=study.exp.eval_batches
    )
    grid = _Grid(study, run_dir, main, batches, corpus.bytes_per_token, meter)
    grid.run(progress)
    grid.run(progress, grid.test_plan())  # after the grid: its choices are read from the selection rows
    seconds["merge_eval"] = time.perf_counter() - t
    if study.exp.plane_grid:
        from pmakit.lab.plane import experiment_plane

        t = time.perf_counter()
        experiment_plane(grid, run_dir, size=study.exp.plane_grid, batches=study.exp.plane_batches)
        seconds["plane"] = time.perf_counter() - t
    meter.end("plane")
    t = time.perf_counter()
    experiment_spectrum(run_dir, cfg.warmup_tokens, study.exp.method_n)
    seconds["spectrum"] = time.perf_counter() - t
    return grid, {**held.describe(), "batches": {k: len(v) for k, v in batches.items()}}


class _Grid:
    """Evaluates latest, annealed and merged models at each fork's end, appending rows as they finish.

    The grid (``plan``) is scored on the selection split; the headline (``test_plan``) on the test split, its
    choices read from the selection rows only.
    """

    def __init__(
        self,
        study: Study,
        run_dir: Path,
        trainer: Trainer,
        batches: Mapping[str, Sequence[Any]],
        bytes_per_token: float | None,
        meter: StudyProgress | None = None,
    ) -> None:
        self.study = study
        self.meter = meter or StudyProgress({})
        self.run_dir = run_dir
        self.trainer = trainer
        self.batches = batches["selection"]
        self.test_batches = batches["test"]
        self.bytes_per_token = bytes_per_token
        self.snapshots = {s.tokens: s for s in discover(snapshots_dir(run_dir / MAIN_RUN))}
        self._states: dict[int, dict[str, torch.Tensor]] = {}
        self.results = ResultRows(run_dir / RESULTS, _key, _current_rows(run_dir))
        self.rows = self.results.rows
        self._latest: dict[tuple[int, str], EvalResult] = {}
        self.compiled = study.exp.compiled
        self.scorer = SplitScorer(trainer.model, batches, bytes_per_token, compiled=self.compiled)

    # -- what to evaluate

    def plan(self) -> list[dict[str, Any]]:
        return self.plan_of(self.study)

    @staticmethod
    def plan_of(study: Study) -> list[dict[str, Any]]:
        """The grid on the selection split (``plan``)."""
        exp, v0 = study.exp, study.train.every_tokens
        items: list[dict[str, Any]] = []
        for fork in study.forks:
            e = fork.eval_tokens
            base = {"fork_tokens": fork.fork_tokens, "tokens": e}
            items.append({**base, "model": "latest"})
            items.append({**base, "model": "annealed"})
            for n in exp.ns:
                for vm in exp.v_multiples:
                    items.append({**base, "model": "merged", "method": "sma", "n": n, "v_tokens": vm * v0})
            for method in exp.methods:
                for alpha in exp.alphas if uses_alpha(method) else (None,):
                    item = {
                        **base,
                        "model": "merged",
                        "method": method,
                        "n": exp.method_n,
                        "v_tokens": v0,
                        "alpha": alpha,
                    }
                    if method != "sma":
                        items.append(item)
        # E1: latest vs SMA along the stable phase (fork_tokens empty)
        end = study.train.total_tokens
        first = study.train.warmup_tokens + exp.method_n * v0
        for k in range(1, exp.points + 1):
            e = round((first + (end - first) * k / (exp.points + 1)) / v0) * v0
            items.append({"fork_tokens": None, "tokens": e, "model": "latest"})
            items.append(
                {
                    "fork_tokens": None,
                    "tokens": e,
                    "model": "merged",
                    "method": "sma",
                    "n": exp.method_n,
                    "v_tokens": v0,
                }
            )
        # the latest row at each point first: merges are compared with it
        items = [{**i, "split": "selection", "role": ""} for i in items]
        return [i for i in items if i["model"] == "latest"] + [i for i in items if i["model"] != "latest"]

    def test_plan(self) -> list[dict[str, Any]]:
        """The headline models at each fork, on the test split: the choices come from the selection rows only."""
        v0, items = self.study.train.every_tokens, []
        for fork in self.study.forks:
            base = {"fork_tokens": fork.fork_tokens, "tokens": fork.eval_tokens, "split": "test"}
            items += [{**base, "model": "latest", "role": ""}, {**base, "model": "annealed", "role": ""}]
            chosen = [
                r
                for r in self.rows
                if r["model"] == "merged"
                and r["fork_tokens"] == fork.fork_tokens
                and r["split"] == "selection"
            ]
            cells: list[dict[str, Any]] = []
            for role, pool in (("best", chosen), ("best-sma", [r for r in chosen if r["method"] == "sma"])):
                cell = {k: min(pool, key=lambda r: r["val_loss"]).get(k) for k in _CELL} if pool else None
                if cell is not None and cell not in cells:  # best-sma is the best merge: scored once
                    cells.append(cell)
                    items.append({**base, **cell, "model": "merged", "role": role})
            n = min(FIXED_N, fork.eval_tokens // v0)  # the paper's default, as far as the run has snapshots
            fixed = {"model": "merged", "method": "sma", "n": n, "v_tokens": v0, "role": "fixed"}
            items.append({**base, **fixed})
            if self.study.exp.tune_evals:
                items.append({**base, "model": "merged", "method": "tuned", "role": "tuned"})
            if self.study.exp.oracle:  # for scale: scored on test, never chosen from
                for n in self.study.exp.ns:
                    for vm in self.study.exp.v_multiples:
                        cell = {"method": "sma", "n": n, "v_tokens": vm * v0}
                        items.append({**base, **cell, "model": "merged", "role": "oracle"})
        return items

    def run(self, progress: bool, plan: list[dict[str, Any]] | None = None) -> None:
        plan = self.plan() if plan is None else plan
        todo = [i for i in plan if _key(i) not in self.results]
        split = plan[0]["split"] if plan else "selection"
        if not todo:
            log.info("evaluations on the %s split: already done", split)
            return
        units = [self._units(item) for item in todo]
        self.meter.resize(split, sum(units))
        log.info(
            "evaluating %d models on %d %s batches; %s",
            len(todo),
            len(self.scorer.batches[split]),
            split,
            self.meter.note(),
        )
        done = 0.0
        with _bar(len(todo), progress, f"evaluating ({split} split)") as advance:
            for item, cost in zip(todo, units, strict=True):
                row = self._evaluate(item)
                if row is not None:
                    self._append(row)
                done += cost
                advance(self.meter.at(split, done))
        self.meter.end(split)

    def _units(self, item: Mapping[str, Any]) -> float:
        """``item``'s evaluation in trained-token equivalents (``StudyProgress``)."""
        scored = _scored_units(self.study, len(self.scorer.batches[item["split"]]))
        return scored + (_tune_units(self.study, len(self.batches)) if item.get("method") == "tuned" else 0.0)

    # -- evaluation

    def _evaluate(self, item: dict[str, Any]) -> dict[str, Any] | None:
        tokens, split = item["tokens"], item["split"]
        if item["model"] == "latest":
            snap = self.snapshot_at(tokens)
            result = self._score(self.state(snap), split)
            self._latest[tokens, split] = result
            row = {**item, "label": f"latest snapshot ({format_tokens(tokens)})"}
        elif item["model"] == "annealed":
            branch = checkpoint_dir(anneal_run(self.run_dir, item["fork_tokens"]))
            result = self._score(read_state(branch), split)
            row = {**item, "label": f"anneal from {format_tokens(item['fork_tokens'])}"}
        elif item["method"] == "tuned":
            chosen, weights, row = self._tune(item)
            result = self._score(self.average(chosen, weights), split)
        else:
            found = self.window(tokens, item["n"], item["v_tokens"])
            if found is None:
                return None  # the window reaches back before the first snapshot: not evaluated
            chosen, weights = found, get_weights(item["method"], len(found), alpha=item.get("alpha") or 0.2)
            result = self._score(self.average(chosen, weights), split)
            row = {**item, "window_start_tokens": chosen[0].tokens, "label": _label(item, self.study.train)}
        latest = self._latest_result(tokens, split)
        delta, se = paired_difference(result, latest) if item["model"] != "latest" else (0.0, 0.0)
        return {
            **{c: None for c in RESULT_COLUMNS},
            **row,
            "val_loss": result.loss,
            "val_loss_se": result.loss_se,
            "bpb": result.bpb,
            "delta_vs_latest": delta,
            "delta_se": se,
            "batch_losses": result.batch_losses,
        }

    def _score(self, state: Mapping[str, torch.Tensor], split: str) -> EvalResult:
        return self.scorer(state, split)

    def _losses(self, state: Mapping[str, torch.Tensor], split: str) -> Generator[float, None, None]:
        """``state``'s loss on each batch of ``split`` in turn (the tuner may stop part way)."""
        return self.scorer.losses(state, split)

    def _grid_cells(self, item: Mapping[str, Any], space: Space, scorer: Scorer) -> list[dict[str, Any]]:
        """The fork's grid merges as the tuner's parameters, best first on the selection split, each primed into
        the scorer with its measured score (the same batches), so the search starts from the grid at no cost."""
        rows = [
            r
            for r in self.rows
            if r["model"] == "merged"
            and r["split"] == "selection"
            and r["fork_tokens"] == item["fork_tokens"]
            and r["method"] in space.config.families
            and r.get("batch_losses")
            and space.interval
            and r["v_tokens"] % space.interval == 0
        ]
        cells = []
        for r in sorted(rows, key=lambda r: r["val_loss"]):
            params = {
                "end_back": 0,
                "v_mult": r["v_tokens"] // space.interval,
                "n": r["n"],
                "family": r["method"],
            }
            if uses_alpha(r["method"]):
                params["alpha"] = r["alpha"]
            result = EvalResult(r["val_loss"], r["val_loss_se"], r.get("bpb"), list(r["batch_losses"]))
            scorer.prime(space.candidate(params), "selection", result)
            cells.append(params)
        return cells

    def _tune(self, item: Mapping[str, Any]) -> tuple[list[Snapshot], list[float], dict[str, Any]]:
        """``pmakit tune``'s search over the snapshots up to the fork's end, scored on the selection split."""
        from pmakit.lab.tune import (
            Scorer,
            Space,
            TuneConfig,
            add_learned_trial,
            chosen_candidate,
            scored,
            search,
            spectrum_hint,
        )

        exp = self.study.exp
        config = TuneConfig(
            budget_evals=exp.tune_evals,
            learn_steps=exp.tune_learn_steps,
            seed=self.study.train.seed,
            max_n=2 * max((*exp.ns, FIXED_N)),  # room past the grid's edge
            v_multiples=tuple(sorted({1, *exp.v_multiples})),
        )
        pool = [s for t, s in sorted(self.snapshots.items()) if t <= item["tokens"]]
        space = Space.of(pool, config)
        scorer = Scorer(
            lambda c, split: self._losses(self.average(c.snapshots, c.weights), split),
            bytes_per_token=self.bytes_per_token,
        )
        hint = spectrum_hint(pool, config)  # the same first guess as `pmakit tune`
        grid = self._grid_cells(item, space, scorer)
        trials = search(space, scorer, config, [*grid[:5], *([hint["params"]] if hint else [])])
        learned = add_learned_trial(space, scorer, trials, self._learn, config)
        c = chosen_candidate(space, trials)
        chosen, p = list(c.snapshots), c.params
        alpha = f"({p['alpha']:.2g})" if p.get("alpha") else ""
        label = (
            f"{p['family']}{alpha} N={p['n']} V={format_tokens(p['v_tokens'])} ending at "
            f"{format_tokens(p['end_tokens'])} (best of {len(trials)} trials)"
        )
        row = {
            **item,
            "n": len(chosen),
            "v_tokens": p["v_tokens"],
            "alpha": p.get("alpha"),
            "window_start_tokens": chosen[0].tokens,
            "label": label,
            "tune": {
                **c.record(),
                "trials": len(trials),
                "evaluations": scorer.evaluations["selection"],  # the rest were the grid's, reused
                "stopped_early": scorer.stopped,
                "batches_scored": scorer.batches["selection"],
                "learned_batches": learned["learn"]["batches"] if learned else 0,
                "selection_loss": min(t["selection_loss"] for t in scored(trials)),
            },
        }
        return chosen, list(c.weights), row

    def _learn(self, candidate: Candidate, steps: int) -> tuple[list[float], int]:
        from pmakit.lab.tune import learn_weights

        states = [self.state(s) for s in candidate.snapshots]
        return learn_weights(self.trainer.model, states, candidate.weights, self.batches, steps=steps)

    def _latest_result(self, tokens: int, split: str) -> EvalResult:
        if (tokens, split) not in self._latest:
            row = next(
                (
                    r
                    for r in self.rows
                    if r["model"] == "latest" and r["tokens"] == tokens and r["split"] == split
                ),
                None,
            )
            if row is None:
                raise PmakitError(f"internal: no latest evaluation at {tokens} tokens on the {split} split")
            self._latest[tokens, split] = EvalResult(
                row["val_loss"], row["val_loss_se"], row["bpb"], row["batch_losses"]
            )
        return self._latest[tokens, split]

    def snapshot_at(self, tokens: int) -> Snapshot:
        if tokens not in self.snapshots:
            raise PmakitError(f"no snapshot at {tokens} tokens in {self.run_dir / 'main' / 'snapshots'}")
        return self.snapshots[tokens]

    def window(self, end: int, n: int, v: int) -> list[Snapshot] | None:
        targets = [end - k * v for k in range(n)][::-1]
        if any(t not in self.snapshots for t in targets):
            return None
        return [self.snapshots[t] for t in targets]

    def state(self, snap: Snapshot) -> dict[str, torch.Tensor]:
        if snap.tokens not in self._states:
            self._states[snap.tokens] = read_state(snap.path)
        return self._states[snap.tokens]

    def average(self, chosen: Sequence[Snapshot], weights: Sequence[float]) -> dict[str, torch.Tensor]:
        return average_states([self.state(s) for s in chosen], weights)

    def _append(self, row: dict[str, Any]) -> None:
        self.results.add(row)
        write_csv(
            self.run_dir / RESULTS_CSV, RESULT_COLUMNS, self.rows
        )  # rewritten from results.jsonl on resume

    # -- the headline merge, written by the real engine

    def write_headline_merge(self) -> dict[str, Any] | None:
        """The best SMA at the last fork, merged by ``pmakit merge`` into RUN/merged (loads with from_pretrained)."""
        from pmakit.merge import merge

        last = self.study.forks[-1]
        rows = [
            r
            for r in self.rows
            if r["model"] == "merged"
            and r["fork_tokens"] == last.fork_tokens
            and r["method"] == "sma"
            and r["split"] == "selection"  # a choice: never made on the test split
        ]
        if not rows:
            return None
        best = min(rows, key=lambda r: r["val_loss"])
        chosen = self.window(best["tokens"], best["n"], best["v_tokens"])
        assert chosen is not None
        out = self.run_dir / "merged"
        merge(
            chosen,
            get_weights("sma", len(chosen)),
            out,
            force=True,
            manifest_extra={
                "method": "sma",
                "selection": {"last": best["n"], "every": best["v_tokens"], "until": best["tokens"]},
                "experiment_row": best["label"],
            },
        )
        # relative to the study, which may be moved or named by another path before its report is built
        return {"path": run_relative(out, self.run_dir), "label": best["label"], "val_loss": best["val_loss"]}


_CELL = ("method", "n", "v_tokens", "alpha")
"""What defines a merge of the grid (with the fork and its tokens)."""


def _key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    keys: tuple[str, ...] = (
        "fork_tokens",
        "model",
        "method",
        "n",
        "v_tokens",
        "alpha",
        "tokens",
        "split",
        "role",
    )
    if row.get("role") in (
        "best",
        "best-sma",
        "tuned",
    ):  # chosen from rows that may still change: one per role
        keys = ("fork_tokens", "model", "tokens", "split", "role")
    return tuple(row.get(k) for k in keys)


def _current_rows(run_dir: Path) -> list[dict[str, Any]]:
    """results.jsonl, unless an older pmakit scored it on the whole held-out set (no ``split``): that file is set
    aside as results-whole-val.jsonl and every model is evaluated again (training is kept)."""
    path = run_dir / RESULTS
    rows = read_jsonl(path)
    if rows and any("split" not in r for r in rows):
        log.warning(
            "%s was scored on the whole held-out set (an older pmakit); kept as results-whole-val.jsonl, "
            "evaluating again on the selection and test splits",
            path,
        )
        path.replace(run_dir / "results-whole-val.jsonl")
        return []
    return rows


def _label(item: Mapping[str, Any], cfg: TrainConfig) -> str:
    method = item["method"].upper() if item["method"] in ("sma", "wma", "ema") else item["method"]
    alpha = f"({item['alpha']:g})" if item.get("alpha") is not None else ""
    vm = item["v_tokens"] // cfg.every_tokens
    return f"{method}{alpha} N={item['n']} V={vm}x ({format_tokens(item['v_tokens'])})"


def _write_curves(run_dir: Path, study: Study) -> None:
    """Loss-vs-tokens of the constant-LR run, its online merge, and each anneal branch (from metrics.jsonl)."""
    from pmakit.metrics import read_metrics

    rows: list[tuple[str, int, float, float]] = []
    for r in read_metrics(run_dir / MAIN_RUN):
        if r.get("kind") == "eval":
            rows.append((r["model"], r["tokens"], r["val_loss"], r["val_loss_se"]))
    for fork in study.forks:
        series = f"anneal@{fork.fork_tokens}"
        for r in read_metrics(anneal_run(run_dir, fork.fork_tokens)):
            if r.get("kind") == "eval" and r.get("model") == "latest":
                rows.append((series, r["tokens"], r["val_loss"], r["val_loss_se"]))
    seen = set()
    with open(run_dir / "curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["series", "tokens", "val_loss", "val_loss_se"])
        for row in rows:
            if row[:2] not in seen:  # a resumed run may have evaluated a point twice
                seen.add(row[:2])
                w.writerow(row)


def _write_experiment_json(
    run: StudyRun,
    study: Study,
    trainer: Trainer,
    corpus: Any,
    seconds: dict[str, float],
    headline: dict[str, Any] | None,
    heldout: dict[str, Any],
) -> None:
    previous = run.previous()
    record = {
        "preset": study.preset,
        "config": _config_stamp(study),
        "started": previous.get("started", run.started),
        "finished": utc_now(),
        # Time spent over every invocation: a resumed study adds what this one did to what the earlier ones did.
        "seconds": {k: round(v + previous.get("seconds", {}).get(k, 0.0), 1) for k, v in seconds.items()},
        "model": trainer.describe(),
        "corpus": jsonable(corpus.files),
        "forks": [{**asdict(f), "eval_tokens": f.eval_tokens} for f in study.forks],
        "base_every_tokens": study.train.every_tokens,
        "tokens_per_step": study.train.tokens_per_step,
        "headline_merge": headline,
        # grid and choices on the selection split, the headline on the test split: disjoint held-out files
        "heldout": heldout,
        "pmakit_version": pmakit.__version__,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    (run.dir / "experiment.json").write_text(json.dumps(record, indent=2) + "\n")


_ANALYSIS_ONLY = ("plane_grid", "plane_batches", "compile_eval", "oracle", "downstream")
# What a run stamped before a key existed did, where that is not the key's default (a new key's default is what the
# run did otherwise): before tune_learn_steps, the tuner learned no weights.
_BEFORE_THE_KEY: dict[str, dict[str, Any]] = {"experiment": {"tune_learn_steps": 0}}


def _config_stamp(study: Study) -> dict[str, Any]:
    """What RUN/config.json holds: the resolved train and experiment sections."""
    return {"train": jsonable(study.train.to_dict()), "experiment": jsonable(asdict(study.exp))}


def _stamp_rules() -> dict[str, Any]:
    """How a resumed study's config is compared with its stamp (``pmakit.lab.context.check_same_config``)."""
    defaults = {"train": _defaults(TrainConfig), "experiment": _defaults(ExperimentConfig)}
    for section, values in _BEFORE_THE_KEY.items():
        defaults[section] = {**defaults[section], **values}
    return {"ignore": {"experiment": _ANALYSIS_ONLY}, "defaults": defaults, "indent": 2}


def _check_same_config(run_dir: Path, study: Study) -> None:
    """Resuming with another config would mix two studies in one results file: refuse it."""
    check_same_config(run_dir, _config_stamp(study), **_stamp_rules())


def _defaults(cls: type) -> dict[str, Any]:
    """A config dataclass's field defaults, as stamped in config.json (its fields need not make a valid config)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return jsonable(out)


class _bar:
    """Progress over the models evaluated: a rich bar on a terminal; elsewhere (a log file, a pipe) a line every
    ``every_s`` seconds. Each advance is given the study's progress note, which ends the line."""

    every_s = 30.0

    def __init__(self, total: int, enabled: bool, label: str) -> None:
        import sys

        self._p: Any = None
        self.total, self.enabled, self.label = total, enabled, label
        self._done, self._last = 0, time.monotonic()
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._p = Progress(
                TextColumn(label),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[note]}"),
                console=Console(stderr=True),
                transient=True,
            )
            self._task = self._p.add_task(label, total=total, note="")

    def __enter__(self) -> Any:
        if self._p is not None:
            self._p.start()
        return self._advance

    def _advance(self, note: str = "") -> None:
        import sys

        self._done += 1
        if self._p is not None:
            self._p.update(self._task, advance=1, note=note)
        elif self.enabled and time.monotonic() - self._last >= self.every_s and self._done < self.total:
            self._last = time.monotonic()
            print(f"{self.label}: {self._done}/{self.total} models; {note}", file=sys.stderr, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._p is not None:
            self._p.stop()


def nan_to_none(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else x
