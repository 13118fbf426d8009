"""The ``scaling`` study (``pmakit experiment --preset scaling``): a scaling law from merges instead of anneals.

Per model size, ONE constant-LR trunk with a snapshot every V (V grows with the size, as the paper's intervals do),
and at each token budget D:
- the merge of the trunk's snapshots ending at D (free: no training), with a recipe (weighting, window as a fraction
  of D) chosen among candidates on the selection split of the fitted sizes only;
- the ground truth it stands in for: an anneal branched off the trunk at (1 - f) D, LR to 0 over the last f D
  (Hägele et al. 2024's cooldown, f = 0.2);
- the latest snapshot at D, for reference.
Every reported number is on the test split (held-out batches disjoint from the selection batches). The report
(``pmakit.report.scaling``) fits ``L(N, D) = E + A/N^alpha + B/D^beta`` to the merges and to the anneals separately,
the largest size held out and predicted by both, and bills the compute of each way.

Run directory:
    RUN/SIZE/trunk/              the size's constant-LR run (``pmakit train`` layout: snapshots/, checkpoints/)
    RUN/SIZE/anneal-D/           the anneal branch ending at D
    RUN/selection.jsonl          every candidate recipe at every point, on the selection split
    RUN/results.jsonl|.csv       test-split rows: size, params, tokens, kind (merge|anneal|latest), loss, s.e.
    RUN/timings.json             wall seconds of each trunk, anneal and merge (summed over invocations)
    RUN/experiment.json          ``"study": "scaling"``, the config, the sizes (N, V, budgets, seconds), the recipe
Re-running resumes: finished trunks, anneals and evaluations are not redone; an interrupted run continues from its
last checkpoint.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import torch

from pmakit.config import (
    AT_LEAST_1,
    AT_LEAST_2,
    FRACTION,
    POSITIVE,
    Length,
    OneOf,
    Range,
    Tokens,
    check_fields,
    from_mapping,
)
from pmakit.errors import PmakitError
from pmakit.evaluate import EvalResult
from pmakit.lab.context import Clock, StudyRun, jsonable, open_run
from pmakit.lab.evaldata import study_batches
from pmakit.lab.results import ResultRows, write_csv
from pmakit.lab.scoring import SnapshotStates, SplitScorer
from pmakit.lab.trunk import anneal_branch, train_trunk
from pmakit.limits import BOOTSTRAP_RESAMPLES
from pmakit.report.schema import SCALING_COLUMNS
from pmakit.runs import RESULTS, RESULTS_CSV, anneal_run, atomic_write_json, checkpoint_dir
from pmakit.schedule import DECAY_SHAPES
from pmakit.train.loop import TrainConfig
from pmakit.train.model import ModelConfig
from pmakit.units import format_tokens
from pmakit.weights import get_weights

log = logging.getLogger(__name__)
STUDY = "scaling"
RESULT_COLUMNS = SCALING_COLUMNS


# --------------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class Recipe:
    """A merge candidate: a weighting over the snapshots of the last ``fraction`` x D tokens."""

    method: str = "sma"
    """Weighting (sma, wma, ema, wsm-1sqrt, ...)."""
    fraction: Annotated[float, FRACTION] = 0.2
    """Window length as a fraction of the budget D (WSM: the merge's duration matters most)."""

    def __post_init__(self) -> None:
        check_fields(self, "recipe")

    @property
    def label(self) -> str:
        return f"{self.method} over the last {self.fraction:g} D"


@dataclass(frozen=True)
class Size:
    """One model size (the shared ``train:`` section gives the rest)."""

    name: str
    """Directory name and label."""
    layers: Annotated[int, AT_LEAST_1]
    """Transformer blocks."""
    hidden: Annotated[int, AT_LEAST_1]
    """Width."""
    heads: Annotated[int, AT_LEAST_1]
    """Attention heads."""
    lr: Annotated[float | None, POSITIVE] = None
    """Stable-phase LR of this size (default: ``train.lr``)."""

    def __post_init__(self) -> None:
        check_fields(self, f"{STUDY}.sizes")


@dataclass(frozen=True)
class ScalingConfig:
    """The ``scaling:`` section."""

    sizes: Annotated[tuple[Size, ...], Length(2)] = ()
    """Model sizes, smallest first; the last one is held out of the fits and predicted."""
    budgets: Annotated[tuple[Annotated[Tokens, AT_LEAST_1], ...], Length(2, distinct=True)] = ()
    """Token budgets D (the same for every size), aligned to the largest size's V."""
    every_tokens_largest: Annotated[Tokens, AT_LEAST_1] = 16_384
    """V of the largest size; a size with k times fewer non-embedding parameters snapshots every V / k (rounded to
    a power-of-two fraction, at least one step), so that V grows with the size as the paper's intervals do."""
    anneal_fraction: Annotated[float, FRACTION] = 0.2
    """The anneal branches off at (1 - f) D and decays the LR to 0 over the last f D."""
    anneal_shape: Annotated[str, OneOf(DECAY_SHAPES)] = "1sqrt"
    """Decay shape of the anneals: 1sqrt, linear or cosine."""
    recipes: tuple[Recipe, ...] = (
        Recipe("sma", 0.1),
        Recipe("sma", 0.2),
        Recipe("sma", 0.4),
    )
    """Merge candidates; the one with the least mean selection-split loss over the fitted sizes is reported."""
    max_merged: Annotated[int, AT_LEAST_2] = 16
    """At most this many snapshots in a merge (a long window takes every k-th snapshot)."""
    selection_batches: Annotated[int, AT_LEAST_2] = 12
    """Held-out batches the recipe is chosen on."""
    test_batches: Annotated[int, AT_LEAST_2] = 24
    """Held-out batches every reported loss is measured on (disjoint from the selection batches)."""
    holdout: Annotated[str, OneOf(("largest", "none"))] = "largest"
    """largest: fit without the largest size and predict it; none: fit every size."""
    bootstrap: Annotated[int, Range(0, BOOTSTRAP_RESAMPLES.value)] = 400
    """Bootstrap refits of the report's 95% intervals."""

    def __post_init__(self) -> None:
        check_fields(self, STUDY)  # the bounds declared above
        if len({s.name for s in self.sizes}) != len(self.sizes):
            raise PmakitError("scaling.sizes need distinct names")
        for r in self.recipes:
            get_weights(r.method, 2)  # an unknown weighting fails here, naming the known ones


def _section(data: Mapping[str, Any]) -> ScalingConfig:
    raw = dict(data.get(STUDY) or {})
    if not raw.get("recipes", True):
        del raw["recipes"]  # null or []: the default candidates
    return from_mapping(ScalingConfig, raw, STUDY)


def resolve(data: Mapping[str, Any]) -> tuple[TrainConfig, ScalingConfig]:
    """The config ``data`` checked whole: the base train config and the study."""
    study = _section(data)
    # every_tokens is set per size (plans); the base takes the largest size's, so that it validates
    base = TrainConfig.from_dict({"every_tokens": study.every_tokens_largest, **(data.get("train") or {})})
    return base, study


# --------------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Plan:
    """One size, resolved: its train config, parameter counts, V and the aligned budgets and forks."""

    size: Size
    """The size."""
    train: TrainConfig
    """The trunk's config (constant LR to the last budget, full states kept at the forks)."""
    params: int
    """Non-embedding parameters (the N of the fits)."""
    params_total: int
    """All parameters (a tied embedding counted once)."""
    budgets: tuple[int, ...]
    """Budgets D."""
    forks: tuple[int, ...]
    """Where each budget's anneal branches off the trunk."""


def _count(cfg: ModelConfig, vocab: int) -> tuple[int, int]:
    """(non-embedding, total) parameters of a size, counted on the meta device (nothing allocated)."""
    from pmakit.train.model import build_model, count_parameters

    with torch.device("meta"):
        model: Any = build_model(cfg, vocab)
    embed = model.get_input_embeddings().weight.numel()
    total = count_parameters(model)
    head = 0 if cfg.tie_embeddings else model.get_output_embeddings().weight.numel()
    return total - embed - head, total


def plans(base: TrainConfig, study: ScalingConfig, vocab: int) -> list[Plan]:
    """Every size's trunk config; V_k = V_largest / 2^round(log2(N_largest / N_k)), at least one step."""
    step = base.tokens_per_step
    if study.every_tokens_largest % step:
        raise PmakitError(f"scaling.every_tokens_largest must be a multiple of the tokens per step ({step})")
    models = [replace(base.model, layers=s.layers, hidden=s.hidden, heads=s.heads) for s in study.sizes]
    counts = [_count(m, vocab) for m in models]
    largest = max(c[0] for c in counts)
    budgets = tuple(sorted({max(1, round(b / study.every_tokens_largest)) * study.every_tokens_largest
                            for b in study.budgets}))  # fmt: skip
    out = []
    for size, model, (params, total) in zip(study.sizes, models, counts):
        v = study.every_tokens_largest // 2 ** round(math.log2(largest / params))
        v = max(step, v // step * step)
        forks = tuple(d - round(study.anneal_fraction * d / step) * step for d in budgets)
        if min(forks) <= base.warmup_tokens:
            raise PmakitError(f"the first anneal starts at {format_tokens(min(forks))}, inside the warmup")
        cfg = replace(
            base, model=model, lr=size.lr or base.lr, every_tokens=v, total_tokens=max(budgets), decay_tokens=0,
            keep_checkpoints_at=forks, eval_every=0, average_last=1,
            checkpoint_every_tokens=max(step, max(budgets) // 10 // step * step),
        )  # fmt: skip
        out.append(Plan(size, cfg, params, total, budgets, forks))
    return out


# --------------------------------------------------------------------------------------------------- scoring


def window(plan: Plan, recipe: Recipe, budget: int, max_merged: int) -> list[int]:
    """Token counts of the snapshots a recipe merges at ``budget``, oldest first.

    About ``fraction`` x D of training ending at D, in at most ``max_merged`` snapshots: every k-th snapshot of the
    trunk (k >= 1), e.g. V = 4K, D = 400K, fraction 0.2, max 16: k = 1 (80K / 4K = 20 > 16, so k = 2: 10 snapshots
    8K apart, [328K, 400K]).
    """
    v = plan.train.every_tokens
    span = recipe.fraction * budget
    spacing = v * max(1, math.ceil(span / (max_merged * v)))
    count = max(2, round(span / spacing))
    return [budget - k * spacing for k in range(count)][::-1]


def _key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a result row measured: a resumed study skips it."""
    return row["size"], row["tokens"], row["kind"], row.get("recipe") or ""


@dataclass
class _Size:
    """What one size is scored with: its plan, a scorer and its trunk's snapshots."""

    plan: Plan
    score: SplitScorer
    snapshots: SnapshotStates

    def merged(self, recipe: Recipe, budget: int, max_merged: int) -> tuple[dict[str, Any], list[int]]:
        tokens = window(self.plan, recipe, budget, max_merged)
        return self.snapshots.merged(tokens, recipe.method), tokens


def _row(plan: Plan, budget: int, kind: str, result: EvalResult, **extra: Any) -> dict[str, Any]:
    return {
        "size": plan.size.name, "params": plan.params, "params_total": plan.params_total, "tokens": budget,
        "kind": kind, "recipe": "", **extra, "val_loss": result.loss, "val_loss_se": result.loss_se,
        "bpb": result.bpb, "batch_losses": result.batch_losses,
    }  # fmt: skip


def _score_references(size: _Size, study: ScalingConfig, run_dir: Path, test: ResultRows,
                      selection: ResultRows) -> None:  # fmt: skip
    """Test rows of the anneal and the latest snapshot, selection rows of every candidate recipe."""
    from pmakit.formats import read_state

    plan, score, name = size.plan, size.score, size.plan.size.name
    for budget in plan.budgets:
        if (name, budget, "anneal", "") not in test:
            result = score(read_state(checkpoint_dir(anneal_run(run_dir / name, budget))), "test")
            test.add(_row(plan, budget, "anneal", result, label=f"anneal from {format_tokens(budget)}"))
        if (name, budget, "latest", "") not in test:
            state = size.snapshots.merged([budget])
            test.add(_row(plan, budget, "latest", score(state, "test"), label="latest snapshot"))
        for recipe in study.recipes:
            if (name, budget, "candidate", recipe.label) in selection:
                continue
            state, tokens = size.merged(recipe, budget, study.max_merged)
            selection.add(_row(plan, budget, "candidate", score(state, "selection"), recipe=recipe.label,
                               window_start_tokens=tokens[0], merged=len(tokens)))  # fmt: skip
            size.snapshots.clear()  # one window's states in memory at a time (a size may be large)


def choose_recipe(
    study: ScalingConfig, plans_: Sequence[Plan], selection: Sequence[Mapping[str, Any]]
) -> tuple[Recipe, list[dict[str, Any]]]:
    """The recipe with the least mean selection-split loss over the fitted sizes (the held-out size never votes)."""
    fitted = {p.size.name for p in plans_}
    if study.holdout == "largest":
        fitted.discard(max(plans_, key=lambda p: p.params).size.name)
    table = []
    for recipe in study.recipes:
        losses = [r["val_loss"] for r in selection if r["recipe"] == recipe.label and r["size"] in fitted]
        table.append({"recipe": recipe.label, "mean_loss": sum(losses) / len(losses), "points": len(losses)})
    best = min(range(len(table)), key=lambda i: table[i]["mean_loss"])
    return study.recipes[best], table


def _score_merges(size: _Size, study: ScalingConfig, recipe: Recipe, test: ResultRows, clock: Clock) -> None:
    """The chosen recipe's merge at every budget, on the test split; the merge (reads + average) is timed."""
    plan = size.plan
    for budget in plan.budgets:
        if (plan.size.name, budget, "merge", recipe.label) in test:
            continue
        t = time.perf_counter()
        state, tokens = size.merged(recipe, budget, study.max_merged)
        size.snapshots.clear()  # timed as a merge from disk: every snapshot read
        clock.add(f"{plan.size.name}/merge-{budget}", time.perf_counter() - t)
        label = f"{recipe.method.upper()} of {len(tokens)} snapshots, {format_tokens(tokens[0])}..{format_tokens(budget)}"
        test.add(_row(plan, budget, "merge", size.score(state, "test"), recipe=recipe.label,
                      window_start_tokens=tokens[0], merged=len(tokens), label=label))  # fmt: skip


# --------------------------------------------------------------------------------------------------- the run


def _size_record(plan: Plan, clock: Clock) -> dict[str, Any]:
    s = clock.seconds
    name = plan.size.name
    trunk = s.get(f"{name}/trunk", 0.0)
    return {
        **asdict(plan.size), "lr": plan.train.lr, "params": plan.params, "params_total": plan.params_total,
        "every_tokens": plan.train.every_tokens, "budgets": list(plan.budgets), "forks": list(plan.forks),
        "anneal_tokens": [d - f for d, f in zip(plan.budgets, plan.forks)],
        "seconds": {"trunk": trunk, "anneals": sum(s.get(f"{name}/anneal-{d}", 0.0) for d in plan.budgets),
                    "merges": sum(s.get(f"{name}/merge-{d}", 0.0) for d in plan.budgets)},
        "trunk_tokens_per_s": plan.train.total_tokens / trunk if trunk else None,
    }  # fmt: skip


def run_study(
    data: Mapping[str, Any], run_dir: str | Path, *, fresh: bool = False, progress: bool = True
) -> Path:
    """Run (or resume) the study into ``run_dir``; returns the report's path."""
    from pmakit.train.loop import load_corpus

    base, study = resolve(data)
    run = open_run(run_dir, jsonable({"train": base.to_dict(), STUDY: asdict(study)}), fresh=fresh)
    run_dir, clock = run.dir, run.clock
    corpus = load_corpus(base)
    all_plans = plans(base, study, corpus.vocab_size)
    batches = study_batches(corpus, base.batch_size, base.model.seq_len, study.selection_batches,
                            study.test_batches)  # fmt: skip
    test, selection = ResultRows(run_dir / RESULTS, _key), ResultRows(run_dir / "selection.jsonl", _key)
    sizes = []
    for plan in all_plans:
        name, cfg = plan.size.name, plan.train
        train_trunk(name, cfg, run_dir, corpus, clock, progress)
        for budget, fork in zip(plan.budgets, plan.forks):
            anneal_branch(name, cfg, study.anneal_shape, budget, fork, run_dir, corpus, clock, progress)
        score = SplitScorer.build(cfg.model, corpus, batches, seed=cfg.seed)
        sizes.append(_Size(plan, score, SnapshotStates(run_dir / name / "trunk")))
        _score_references(sizes[-1], study, run_dir, test, selection)
    recipe, table = choose_recipe(study, all_plans, selection.rows)
    log.info("merge recipe chosen on the selection split: %s", recipe.label)
    for size in sizes:
        _score_merges(size, study, recipe, test, clock)
    write_csv(run_dir / RESULTS_CSV, RESULT_COLUMNS, test.rows)
    _write_record(run, data, base, study, all_plans, recipe, table)
    from pmakit.report import write_report

    return Path(write_report(run_dir).html)


def _write_record(run: StudyRun, data: Mapping[str, Any], base: TrainConfig, study: ScalingConfig,
                  all_plans: Sequence[Plan], recipe: Recipe, table: list[dict[str, Any]]) -> None:  # fmt: skip
    clock = run.clock
    record = {
        "study": STUDY,
        "preset": data.get("preset"),
        "config": jsonable({"train": base.to_dict(), STUDY: asdict(study)}),
        "sizes": [_size_record(p, clock) for p in all_plans],
        "recipe": {**asdict(recipe), "label": recipe.label},
        "selection": table,
        "seconds": dict(clock.seconds),
        **run.stamp(),
    }
    atomic_write_json(run.dir / "experiment.json", record)
