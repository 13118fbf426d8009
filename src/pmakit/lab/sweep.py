"""The ``sweep`` study (``pmakit experiment --preset sweep``): can merges decide a hyper-parameter sweep early?

K candidates (the product of ``lrs`` x ``weight_decays`` x ``batch_sizes``), each ONE constant-LR trunk with a
snapshot every V, all on the same data order (``train.seed``). At each early point b (a fraction of the budget D)
and at D itself, every candidate is scored four ways:
- ``latest``: the newest snapshot at b;
- ``fixed``: the fixed recipe, SMA of the last ``fixed_n`` snapshots ending at b (the paper's default);
- ``tuned``: the merge recipe (weighting, window as a fraction of b) with the least loss on the selection split,
  chosen per candidate and point among ``recipes`` and the fixed recipe;
- ``anneal``: a short anneal branched off the trunk at (1 - f) b, LR to 0 by b (the cooldown of Hägele et al.).
The truth is each candidate's anneal at the full budget D; the anneals at the early points are the cheaper truths.
Every reported loss is on the test split (held-out batches disjoint from the selection batches) with its per-batch
losses, so the report (``pmakit.report.sweep``) can bootstrap the rank agreement over test batches.

Run directory:
    RUN/CANDIDATE/trunk/          the candidate's constant-LR run (``pmakit train`` layout)
    RUN/CANDIDATE/anneal-B/       its anneal ending at B tokens
    RUN/selection.jsonl           every recipe at every (candidate, point), on the selection split
    RUN/results.jsonl|.csv        test rows: candidate, lr, weight_decay, batch_size, tokens, kind, recipe, loss
    RUN/timings.json              wall seconds of each trunk, anneal, and read + merge (summed over invocations)
    RUN/experiment.json           ``"study": "sweep"``, the config, the candidates, the budgets and the seconds
Re-running resumes: finished trunks, anneals and evaluations are not redone.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Annotated, Any

from pmakit.config import (
    AT_LEAST_1,
    AT_LEAST_2,
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    Length,
    OneOf,
    Tokens,
    check_fields,
    from_mapping,
)
from pmakit.errors import PmakitError
from pmakit.evaluate import EvalResult
from pmakit.lab.context import Clock, StudyRun, jsonable, open_run
from pmakit.lab.evaldata import study_batches
from pmakit.lab.results import ResultRows, write_csv
from pmakit.lab.scaling import Recipe
from pmakit.lab.scoring import SnapshotStates, SplitScorer
from pmakit.lab.trunk import anneal_branch, train_trunk
from pmakit.limits import BOOTSTRAP_RESAMPLES, refuse
from pmakit.report.schema import SWEEP_COLUMNS
from pmakit.runs import RESULTS, RESULTS_CSV, anneal_run, atomic_write_json, checkpoint_dir
from pmakit.schedule import DECAY_SHAPES
from pmakit.train.loop import TrainConfig
from pmakit.units import format_tokens
from pmakit.weights import get_weights

log = logging.getLogger(__name__)
STUDY = "sweep"
KINDS = ("latest", "fixed", "tuned", "anneal")
"""The estimates scored at every point (the anneal at the full budget is the truth)."""
RESULT_COLUMNS = SWEEP_COLUMNS


# --------------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class SweepConfig:
    """The ``sweep:`` section."""

    lrs: Annotated[tuple[Annotated[float, POSITIVE], ...], Length(1)] = ()
    """Peak (stable-phase) LRs swept (about a decade is what a user sweeps)."""
    weight_decays: tuple[Annotated[float, NON_NEGATIVE], ...] = ()
    """AdamW weight decays swept (default: ``train.weight_decay`` only)."""
    batch_sizes: tuple[Annotated[int, AT_LEAST_1], ...] = ()
    """Sequences per step swept (default: ``train.batch_size`` only); V must be a multiple of each one's step."""
    budget: Annotated[Tokens, AT_LEAST_1] = 2_000_000
    """The full budget D: the truth is every candidate annealed to D."""
    points: Annotated[tuple[Annotated[float, FRACTION], ...], Length(1)] = (0.1, 0.25, 0.5)
    """The early points, as fractions of D, where the candidates are ranked by each estimate."""
    every_tokens: Annotated[Tokens, AT_LEAST_1] = 16_384
    """Snapshot interval V (the same for every candidate)."""
    anneal_fraction: Annotated[float, FRACTION] = 0.2
    """Every anneal (the truth and the short ones) branches off at (1 - f) b and decays the LR to 0 by b."""
    anneal_shape: Annotated[str, OneOf(DECAY_SHAPES)] = "1sqrt"
    """Decay shape of the anneals: 1sqrt, linear or cosine."""
    fixed_n: Annotated[int, AT_LEAST_2] = 10
    """N of the fixed recipe: SMA of the last N snapshots (the paper's default)."""
    recipes: tuple[Recipe, ...] = (Recipe("sma", 0.1), Recipe("sma", 0.2), Recipe("sma", 0.4),
                                   Recipe("wsm-1sqrt", 0.4))  # fmt: skip
    """Merge candidates of the tuned merge (window as a fraction of the point b), chosen on the selection split."""
    max_merged: Annotated[int, AT_LEAST_2] = 16
    """At most this many snapshots in a merge (a long window takes every k-th snapshot)."""
    selection_batches: Annotated[int, AT_LEAST_2] = 8
    """Held-out batches the tuned recipe is chosen on."""
    test_batches: Annotated[int, AT_LEAST_2] = 24
    """Held-out batches every reported loss is measured on (disjoint from the selection batches)."""
    bootstrap: Annotated[int, NON_NEGATIVE] = 1000
    """Bootstrap resamples of the test batches behind the report's 95% intervals."""

    def __post_init__(self) -> None:
        check_fields(self, STUDY)  # the bounds declared above
        if len(self.lrs) * max(1, len(self.weight_decays)) * max(1, len(self.batch_sizes)) < 2:
            raise PmakitError("sweep needs lrs and at least 2 candidates (lrs x weight_decays x batch_sizes)")
        for r in self.recipes:
            get_weights(r.method, 2)  # an unknown weighting fails here, naming the known ones
        if self.bootstrap > BOOTSTRAP_RESAMPLES.value:
            raise refuse(BOOTSTRAP_RESAMPLES, f"sweep.bootstrap {self.bootstrap:,}")


def _section(data: Mapping[str, Any]) -> SweepConfig:
    raw = dict(data.get(STUDY) or {})
    if not raw.get("recipes", True):
        del raw["recipes"]  # null or []: the default candidates
    return from_mapping(SweepConfig, raw, STUDY)


def resolve(data: Mapping[str, Any]) -> tuple[TrainConfig, SweepConfig, list[Plan]]:
    """The config ``data`` checked whole (every section's values, then the grid): the base train config, the
    study and every candidate's plan."""
    study = _section(data)
    base = TrainConfig.from_dict({"every_tokens": study.every_tokens, **(data.get("train") or {})})
    return base, study, plans(base, study)


# --------------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Plan:
    """One candidate, resolved: its train config and the budgets it is scored at."""

    name: str
    """Directory name and label (the axes that vary, e.g. ``lr3e-3-wd0.1``)."""
    train: TrainConfig
    """The trunk's config (constant LR to D, full states kept at the forks)."""
    budgets: tuple[int, ...]
    """The early points and D, in tokens (multiples of V)."""
    forks: tuple[int, ...]
    """Where each budget's anneal branches off the trunk."""

    def record(self) -> dict[str, Any]:
        t = self.train
        return {"name": self.name, "lr": t.lr, "weight_decay": t.weight_decay, "batch_size": t.batch_size,
                "tokens_per_step": t.tokens_per_step, "budgets": list(self.budgets), "forks": list(self.forks)}  # fmt: skip


def _name(lr: float, wd: float, bs: int, study: SweepConfig) -> str:
    parts = [f"lr{lr:g}"]
    if len(study.weight_decays) > 1:
        parts.append(f"wd{wd:g}")
    if len(study.batch_sizes) > 1:
        parts.append(f"bs{bs}")
    return "-".join(parts)


def budgets_of(study: SweepConfig) -> tuple[int, ...]:
    """The points and D in tokens, each a multiple of V with at least two snapshots before it."""
    v = study.every_tokens
    out = {max(2, round(p * study.budget / v)) * v for p in study.points}
    return tuple(sorted(out | {max(2, round(study.budget / v)) * v}))


def plans(base: TrainConfig, study: SweepConfig) -> list[Plan]:
    """Every candidate's trunk config."""
    budgets = budgets_of(study)
    grid = itertools.product(study.lrs, study.weight_decays or (base.weight_decay,),
                             study.batch_sizes or (base.batch_size,))  # fmt: skip
    out = []
    for lr, wd, bs in grid:
        step = bs * base.model.seq_len
        if study.every_tokens % step:
            raise PmakitError(
                f"sweep.every_tokens must be a multiple of the tokens per step ({step}, batch {bs})"
            )
        forks = tuple(b - max(1, round(study.anneal_fraction * b / step)) * step for b in budgets)
        if min(forks) <= base.warmup_tokens:
            raise PmakitError(f"the first anneal starts at {format_tokens(min(forks))}, inside the warmup")
        cfg = replace(
            base, lr=lr, weight_decay=wd, batch_size=bs, every_tokens=study.every_tokens, total_tokens=max(budgets),
            decay_tokens=0, keep_checkpoints_at=forks, eval_every=0, average_last=1,
            checkpoint_every_tokens=max(step, max(budgets) // 10 // step * step),
        )  # fmt: skip
        out.append(Plan(_name(lr, wd, bs, study), cfg, budgets, forks))
    if len({p.name for p in out}) != len(out):
        raise PmakitError(
            "sweep candidates must differ: lrs, weight_decays and batch_sizes need distinct values"
        )
    return out


# --------------------------------------------------------------------------------------------------- scoring


def fixed_window(v: int, budget: int, n: int) -> list[int]:
    """The fixed recipe's snapshots at ``budget``, oldest first: the last ``n`` at V, fewer when the run is younger
    (V = 16K, budget 64K, n = 10: [16K, 32K, 48K, 64K])."""
    return [t for t in range(budget - (n - 1) * v, budget + 1, v) if t > 0]


def recipe_window(v: int, recipe: Recipe, budget: int, max_merged: int) -> list[int]:
    """About ``fraction`` x b of training ending at b in at most ``max_merged`` snapshots, every k-th one
    (V = 16K, b = 400K, fraction 0.4, max 16: 160K / 16K = 10 snapshots, [256K, 400K])."""
    span = recipe.fraction * budget
    spacing = v * max(1, math.ceil(span / (max_merged * v)))
    count = max(2, min(round(span / spacing), budget // spacing))
    return [budget - k * spacing for k in range(count)][::-1]


def _key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a result row measured: a resumed study skips it."""
    return row["candidate"], row["tokens"], row["kind"], row.get("recipe") or ""


def _row(plan: Plan, budget: int, kind: str, result: EvalResult, recipe: str = "", window: Sequence[int] = ()
         ) -> dict[str, Any]:  # fmt: skip
    t = plan.train
    return {
        "candidate": plan.name, "lr": t.lr, "weight_decay": t.weight_decay, "batch_size": t.batch_size,
        "tokens": budget, "kind": kind, "recipe": recipe, "window_start_tokens": window[0] if window else None,
        "merged": len(window) or None, "val_loss": result.loss, "val_loss_se": result.loss_se, "bpb": result.bpb,
        "batch_losses": result.batch_losses,
    }  # fmt: skip


FIXED = "fixed"


def _windows(plan: Plan, study: SweepConfig, budget: int) -> dict[str, tuple[str, list[int]]]:
    """Every merge the tuned recipe chooses among at ``budget``: label -> (weighting, snapshot tokens)."""
    v = study.every_tokens
    out = {FIXED: ("sma", fixed_window(v, budget, study.fixed_n))}
    for r in study.recipes:
        out[r.label] = (r.method, recipe_window(v, r, budget, study.max_merged))
    return out


def score_candidate(plan: Plan, study: SweepConfig, run_dir: Path, score: SplitScorer, test: ResultRows,
                    selection: ResultRows, clock: Clock) -> None:  # fmt: skip
    """Every estimate of one candidate at every budget: test rows, and the tuned recipe's selection rows."""
    from pmakit.formats import read_state

    snapshots = SnapshotStates(run_dir / plan.name / "trunk")  # read once each per budget

    for budget in plan.budgets:
        merges = _windows(plan, study, budget)
        for label, (method, tokens) in merges.items():
            if (plan.name, budget, "candidate", label) not in selection:
                selection.add(_row(plan, budget, "candidate", score(snapshots.merged(tokens, method), "selection"),
                                   label, tokens))  # fmt: skip
        rows = [r for r in selection.rows if r["candidate"] == plan.name and r["tokens"] == budget]
        best = min(rows, key=lambda r: r["val_loss"])["recipe"]
        todo = {
            "latest": ("", "sma", [budget]),
            "fixed": (FIXED, *merges[FIXED]),
            "tuned": (best, *merges[best]),
        }
        for kind, (label, method, tokens) in todo.items():
            if (plan.name, budget, kind, label) in test:
                continue
            t = time.perf_counter()
            state = snapshots.merged(tokens, method)
            clock.add(f"{plan.name}/{kind}-{budget}", time.perf_counter() - t)  # reading (+ averaging)
            test.add(
                _row(plan, budget, kind, score(state, "test"), label, tokens if kind != "latest" else ())
            )
        if (plan.name, budget, "anneal", "") not in test:
            branch = checkpoint_dir(anneal_run(run_dir / plan.name, budget))
            test.add(_row(plan, budget, "anneal", score(read_state(branch), "test")))
        snapshots.clear()  # the next budget's windows are mostly other snapshots


# --------------------------------------------------------------------------------------------------- the run


def run_study(
    data: Mapping[str, Any], run_dir: str | Path, *, fresh: bool = False, progress: bool = True
) -> Path:
    """Run (or resume) the study into ``run_dir``; returns the report's path."""
    from pmakit.train.loop import load_corpus

    base, study, all_plans = resolve(data)  # a bad value or grid fails before anything is written
    run = open_run(run_dir, jsonable({"train": base.to_dict(), STUDY: asdict(study)}), fresh=fresh)
    run_dir, clock = run.dir, run.clock
    corpus = load_corpus(base)
    batches = study_batches(corpus, base.batch_size, base.model.seq_len, study.selection_batches,
                            study.test_batches)  # fmt: skip
    test, selection = ResultRows(run_dir / RESULTS, _key), ResultRows(run_dir / "selection.jsonl", _key)
    for plan in all_plans:
        train_trunk(plan.name, plan.train, run_dir, corpus, clock, progress)
        for budget, fork in zip(plan.budgets, plan.forks):
            anneal_branch(
                plan.name, plan.train, study.anneal_shape, budget, fork, run_dir, corpus, clock, progress
            )
        scorer = SplitScorer.build(plan.train.model, corpus, batches, seed=plan.train.seed)
        score_candidate(plan, study, run_dir, scorer, test, selection, clock)
    write_csv(run_dir / RESULTS_CSV, RESULT_COLUMNS, test.rows)
    _write_record(run, data, base, study, all_plans)
    from pmakit.report import write_report

    return Path(write_report(run_dir).html)


def _write_record(run: StudyRun, data: Mapping[str, Any], base: TrainConfig, study: SweepConfig,
                  all_plans: Sequence[Plan]) -> None:  # fmt: skip
    clock = run.clock
    record = {
        "study": STUDY,
        "preset": data.get("preset"),
        "config": jsonable({"train": base.to_dict(), STUDY: asdict(study)}),
        "candidates": [p.record() for p in all_plans],
        "budgets": list(budgets_of(study)),
        "seconds": dict(clock.seconds),
        **run.stamp(),
    }
    atomic_write_json(run.dir / "experiment.json", record)


# --------------------------------------------------------------------------------------------------- sweep-rank


def _resolved(run: Path) -> Path:
    """``run`` with its links resolved; a symlink loop or an unreadable path is one error line."""
    try:
        return run.resolve(strict=True)
    except FileNotFoundError:
        raise PmakitError(f"{run}: no such run directory") from None
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop, on Python < 3.13
        raise PmakitError(
            f"{run}: cannot be read as a run directory ({getattr(e, 'strerror', None) or e})"
        ) from None


def _window_at(run: Path, at: int | None, n: int) -> list[Any]:
    """The last ``n`` snapshots of ``run`` at or before ``at`` tokens (all of its snapshots when ``at`` is None)."""
    from pmakit.snapshot import gather

    if not _resolved(run).is_dir():
        raise PmakitError(f"{run}: no such run directory")
    snapshots, _ = gather([run])
    if (
        at is not None and snapshots[-1].tokens < at
    ):  # its merge would stand for an earlier point than the others'
        raise PmakitError(f"{run}: its newest snapshot is at {format_tokens(snapshots[-1].tokens)} tokens, before "
                          f"--at {format_tokens(at)}; rank at a point every run has reached")  # fmt: skip
    before = [s for s in snapshots if at is None or s.tokens <= at]
    if not before:
        raise PmakitError(f"{run}: no snapshot at or before {format_tokens(at or 0)} tokens (its first is at "
                          f"{format_tokens(snapshots[0].tokens)})")  # fmt: skip
    return before[-n:]


def _vocabulary(snapshot: Path) -> Any:
    try:
        return json.loads((snapshot / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError) as e:
        raise PmakitError(f"{snapshot}: no readable config.json to build the model from ({e})") from e


TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "vocab.txt",
    "added_tokens.json",
)
"""The files that map text to token ids (a fast tokenizer's tokenizer.json holds all of it)."""


def tokenizer_digest(snapshot: Path, run: Path) -> str | None:
    """A digest of the tokenizer ``snapshot`` was trained with (its own files, else ``RUN/tokenizer/``): equal
    digests tokenize alike. ``tokenizer.json`` is compared as parsed JSON less its padding and truncation settings;
    the other files byte for byte. None when neither place holds a tokenizer file."""
    import hashlib

    from pmakit.limits import JSON_BYTES, loads_json, read_regular

    for where in (snapshot, run / "tokenizer"):
        found = [where / name for name in TOKENIZER_FILES if (where / name).is_file()]
        if not found:
            continue
        digest = hashlib.sha256()
        for path in found:
            data = read_regular(path, JSON_BYTES)
            if path.name == "tokenizer.json":
                doc = loads_json(data, str(path))
                if isinstance(doc, dict):
                    doc = {k: v for k, v in doc.items() if k not in ("padding", "truncation")}
                data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
            digest.update(f"{path.name}\0{len(data)}\0".encode() + data)
        return digest.hexdigest()
    return None


def _check_one_tokenizer(windows: Mapping[str, Sequence[Any]]) -> None:
    """The runs share one tokenizer (its files compared; a vocabulary of the same size is not enough), or one
    error line naming a run that differs. Runs without any tokenizer file fall back to the vocabulary size, said
    in a warning."""
    digests = {k: tokenizer_digest(w[-1].path, Path(k)) for k, w in windows.items()}
    missing = [k for k, d in digests.items() if d is None]
    if missing and len(missing) < len(digests):
        raise PmakitError(f"{missing[0]} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...) to compare "
                          "with the other runs': a sweep ranks runs of one tokenizer")  # fmt: skip
    first = next(iter(digests))
    for name, digest in digests.items():
        if digest != digests[first]:
            raise PmakitError(f"{name} and {first} were trained with different tokenizers (their tokenizer files "
                              "differ): a sweep ranks runs of one tokenizer")  # fmt: skip
    vocab = {k: _vocabulary(w[-1].path) for k, w in windows.items()}
    if len(set(vocab.values())) > 1:
        raise PmakitError(
            f"the runs have different vocabularies ({vocab}): a sweep ranks runs of one tokenizer"
        )
    if missing:
        log.warning(
            "no run has tokenizer files: only the vocabulary sizes (%s) could be compared", vocab[first]
        )


def _merge_losses(window: Sequence[Any], batches: Sequence[Any]) -> list[float]:
    """Per-batch test losses of the SMA of ``window``, in a model built from its newest snapshot's config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pmakit.evaluate import batch_losses
    from pmakit.merge import average_states
    from pmakit.recover import read_finite_state
    from pmakit.train.loop import swapped

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(window[-1].path))
    states = (
        read_finite_state(s) for s in window
    )  # one at a time; NaN/Inf is an error naming tensor and snapshot
    with swapped(model, average_states(states, get_weights("sma", len(window)))):
        losses = list(batch_losses(model, batches))
    if not all(math.isfinite(x) for x in losses):
        raise PmakitError(f"the merge of {window[0].path.parent} scores a non-finite loss on the held-out batches: "
                          "it cannot be ranked")  # fmt: skip
    return losses


def _downstream_losses(
    windows: Mapping[str, Sequence[Any]], run: Path, metric: str
) -> dict[str, list[float]]:
    """Per-item test losses of each window's SMA on a downstream metric of ``run``'s held-out tasks (lm-eval)."""
    from pmakit.eval.objective import Downstream
    from pmakit.eval.run import corpus_entry
    from pmakit.merge import average_states
    from pmakit.recover import read_finite_state

    objective = Downstream(metric, next(iter(windows.values()))[-1].path, corpus_entry([run]))
    return {
        name: objective.losses(
            average_states((read_finite_state(s) for s in w), get_weights("sma", len(w))), "test"
        )
        for name, w in windows.items()
    }


def rank_runs(runs: Sequence[Path], *, at: int | None = None, n: int = 10, data: str | None = None,
              batches: int = 16, bootstrap: int = 1000, seed: int = 0, metric: str | None = None
              ) -> dict[str, Any]:  # fmt: skip
    """``pmakit sweep-rank``: each run's fixed-recipe merge (SMA of its last ``n`` snapshots at or before ``at``;
    default: the newest token count every run has reached) scored on the same held-out test batches, ranked with
    bootstrap uncertainty over the batches (``pmakit.report.sweep.rank_table``)."""
    from pmakit.lab.evaldata import load_eval_data
    from pmakit.lab.tune import TuneConfig
    from pmakit.report.sweep import rank_table
    from pmakit.train.data import split_batches as heldout_batches

    if len(runs) < 2 or len({_resolved(r) for r in runs}) < len(runs):
        raise PmakitError("sweep-rank needs at least 2 different run directories")
    if n < 1 or batches < 2 or bootstrap < 0:
        raise PmakitError("--last at least 1, --batches at least 2, --bootstrap 0 or more")
    if bootstrap > BOOTSTRAP_RESAMPLES.value:
        raise refuse(BOOTSTRAP_RESAMPLES, f"--bootstrap {bootstrap:,}")
    if at is None:
        at = min(_window_at(r, None, 1)[-1].tokens for r in runs)
    windows = {str(r): _window_at(r, at, n) for r in runs}
    _check_one_tokenizer(windows)
    if metric is not None:  # items of a downstream task instead of batches of held-out text
        losses = _downstream_losses(windows, runs[0], metric)
        return {
            "at": at, "n": n, "data": f"{metric} per item (lm-eval; metrics where higher is better negated)", "batches":
            len(next(iter(losses.values()))), "batch_size": 1, "seq_len": "item", "bootstrap": bootstrap,
            "metric": metric, "windows": {k: [s.tokens for s in w] for k, w in windows.items()},
            "ranking": rank_table(losses, bootstrap=bootstrap, seed=seed),
        }  # fmt: skip
    first = windows[str(runs[0])][-1]
    found = load_eval_data(data, runs[0], first, TuneConfig(batches=batches, seed=seed))
    test = heldout_batches(
        found.held, batch_size=found.batch_size, seq_len=found.seq_len, max_batches=batches
    )["test"]
    losses = {name: _merge_losses(w, test) for name, w in windows.items()}
    return {
        "at": at, "n": n, "data": found.source, "batches": len(test), "batch_size": found.batch_size,
        "seq_len": found.seq_len, "bootstrap": bootstrap,
        "windows": {k: [s.tokens for s in w] for k, w in windows.items()},
        "ranking": rank_table(losses, bootstrap=bootstrap, seed=seed),
    }  # fmt: skip


def render_ranking(record: Mapping[str, Any]) -> str:
    """The ranking as a terminal table."""
    width = max(3, *(len(r["name"]) for r in record["ranking"]))
    lines = [
        f"Runs ranked at {format_tokens(record['at'])} tokens by the SMA of each run's last {record['n']} snapshots "
        f"at or before it; {record['data']}, test split: {record['batches']} batches of {record['batch_size']} x "
        f"{record['seq_len']} tokens; uncertainty from {record['bootstrap']} resamples of those batches."
        if not record.get("metric")
        else f"at or before it; {record['data']}, {record['batches']} test items; uncertainty from "
        f"{record['bootstrap']} resamples of those items.",
        f"{'rank':>4}  {'run':<{width}}  {'merged':>18}  {'loss ± s.e.':>17}  {'− best ± paired s.e.':>20}  {'P(best)':>7}"
        f"  {'rank 95%':>8}",
    ]
    for i, r in enumerate(record["ranking"], start=1):
        w = record["windows"][r["name"]]
        merged = f"{len(w)}: {format_tokens(w[0])}..{format_tokens(w[-1])}"
        p_best = "–" if r["p_best"] is None else f"{r['p_best']:.0%}"
        ranks = "–" if r["rank_range"] is None else f"{r['rank_range'][0]}-{r['rank_range'][1]}"
        lines.append(f"{i:>4}  {r['name']:<{width}}  {merged:>18}  {r['loss']:.4f} ± {r['loss_se']:.4f}  "
                     f"{r['minus_best']:+.4f} ± {r['minus_best_se']:.4f}  {p_best:>7}  {ranks:>8}")  # fmt: skip
    return "\n".join(lines)
