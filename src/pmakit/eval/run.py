"""``evaluate``: targets x recipes x tasks through lm-eval, one row per (model, task, metric) in ``evals.jsonl``.

A target is a run (each recipe picks and weights its snapshots; the K newest raw snapshots are added for the noise
band), a snapshot, or a model folder (evaluated as it is). Everything a command can get wrong (a recipe the run
cannot satisfy, an unknown task, a model without a config, lm-eval missing) is checked before the first model is
built, so a mistake writes nothing. Rows are appended as each (model, task) finishes, all its metrics in one write;
a (model, task) whose rows are all in the file is not evaluated again, so an interrupted command run again goes on
where it stopped (a line torn by a kill is skipped on reading, ``pmakit.runs.read_jsonl``, and measured again).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError
from pmakit.eval import harness, model, stats
from pmakit.eval.tasks import TASKS, TaskSet, build_tasks
from pmakit.merge.recipe import Resolved, parse_recipe, resolve
from pmakit.runs import atomic_write_text, read_jsonl

log = logging.getLogger(__name__)

EVALS = "evals.jsonl"
REFERENCE = "evals.reference.json"
"""Beside the rows: the reference of the last command that named one (``pmakit report`` compares with it)."""
KEY_FIELDS = ("target", "recipe", "window", "v", "n", "weights_sha", "task", "metric", "limit", "split", "build",
              "lm_eval")  # fmt: skip


@dataclass(frozen=True)
class Spec:
    """What to evaluate every model on."""

    tasks: tuple[str, ...]
    """lm-eval task names (``pmakit_next_line``, ``pmakit_bpb``, ``pmakit_loss`` are built from the run's corpus)."""
    limit: int | None = None
    """Items per task (the first N, as lm-eval's ``--limit``); None: all."""
    split: str = "test"
    """Item split of pmakit's own tasks: ``selection`` (choose on it) or ``test`` (report on it)."""
    noise: int = 4
    """K newest raw snapshots of each run evaluated for the noise band (0: none)."""
    include: tuple[Path, ...] = ()
    """More folders of lm-eval task YAMLs."""
    batch_size: int = 8
    items: int = 500
    """Items per split of pmakit's own tasks when they are built."""

    def __post_init__(self) -> None:
        if not self.tasks:
            raise PmakitError("give at least one task (--tasks T1,T2)")
        if self.limit is not None and self.limit < 1:
            raise PmakitError(f"--limit must be at least 1, got {self.limit}")
        if self.noise < 0 or self.batch_size < 1 or self.items < 2:
            raise PmakitError("--noise must be >= 0, the batch size >= 1 and items >= 2")


@dataclass
class Model:
    """One model to evaluate: a recipe on a run, or a folder as it is."""

    target: str
    recipe: str
    key: dict[str, Any]
    resolved: Resolved | None = None
    path: Path | None = None
    raw_back: int | None = None
    """For one raw snapshot of a run: how many saves before the newest (the noise band's members)."""
    built: model.Built | None = field(default=None, repr=False)

    def build(self) -> model.Built:
        if self.built is None:
            self.built = model.build(self.resolved) if self.resolved else model.build_path(self.path)  # type: ignore[arg-type]
        return self.built


def plan_models(targets: Sequence[str | Path], recipes: Sequence[str], noise: int) -> list[Model]:
    """Every model of the command, checked (recipes against the runs, configs present), none built."""
    from pmakit.snapshot import gather, looks_like_snapshot

    parsed = [parse_recipe(r) for r in (recipes or ["latest"])]
    models: list[Model] = []
    for target in targets:
        path = Path(target)
        if not path.exists():
            raise PmakitError(f"{path}: no such run, snapshot or model folder")
        if looks_like_snapshot(path) or (
            (path / "config.json").is_file() and not (path / "snapshots").is_dir()
        ):
            models.append(Model(str(path), "as-is", {"window": None, "v": None, "n": None}, path=path))
            continue
        snapshots, _ = gather([path])
        noise_recipes = [
            parse_recipe("latest" if k == 0 else f"back:{k}") for k in range(min(noise, len(snapshots)))
        ]
        seen: set[str] = set()
        for recipe in [*parsed, *noise_recipes]:
            resolved = resolve(recipe, snapshots)
            identity = resolved.key["weights_sha"]
            if identity in seen:
                continue
            seen.add(identity)
            back = recipe.back if recipe.raw else None
            models.append(Model(str(path.resolve()), recipe.text, resolved.key, resolved, raw_back=back))
    for m in models:
        model.check_config(m.resolved.snapshots[-1].path if m.resolved else m.path)  # type: ignore[arg-type]
    return models


def corpus_entry(targets: Sequence[str | Path]) -> Path:
    """The tokenized corpus (cache entry) of the first run among ``targets`` that recorded its train config."""
    from pmakit.snapshot import study_main_run
    from pmakit.train.loop import TrainConfig, load_corpus, saved_config

    for target in targets:
        path = study_main_run(Path(target))
        manifest = path / "pmakit-merge.json"
        if manifest.is_file():  # a merge: the run of its newest input
            inputs = json.loads(manifest.read_text()).get("inputs") or [{}]
            path = Path(inputs[-1].get("path") or path)
        for run in (path, path.parent, path.parent.parent):
            config = saved_config(run)
            if config is not None:
                corpus = load_corpus(TrainConfig.from_dict(config))
                if corpus.tokenizer_dir is None:
                    raise PmakitError(
                        f"{run}: its corpus is pre-tokenized; pmakit's text tasks need text files"
                    )
                return Path(corpus.files["cache"])
    raise PmakitError(
        f"pmakit's own tasks ({', '.join(TASKS)}) are built from a run's held-out files; none of "
        f"{', '.join(map(str, targets))} is a pmakit run with its checkpoint (RUN/checkpoint/trainer.pt)"
    )


def check_tokenizer(entry: Path, snapshot: Path) -> None:
    """The corpus rebuilt from a run's config must be the one it trained on: its tokenizer is the snapshots' (else
    its "held-out" files may be another corpus's, or training files)."""
    import json

    def vocab(path: Path) -> Any:
        data = json.loads(path.read_text())
        return data.get("model", {}).get("vocab"), data.get("model", {}).get("merges")

    ours, theirs = entry / "tokenizer" / "tokenizer.json", snapshot / "tokenizer.json"
    if ours.is_file() and theirs.is_file() and vocab(ours) != vocab(theirs):
        raise PmakitError(
            f"the corpus rebuilt from the run's config ({entry}) has another tokenizer than its snapshots "
            f"({theirs}): its held-out files cannot be trusted to be the run's; pass --corpus-of the run that "
            "trained this model, with the pmakit version that trained it"
        )


def prepare_tasks(
    spec: Spec, targets: Sequence[str | Path], corpus: Path | None = None, snapshot: Path | None = None
) -> tuple[Any, TaskSet | None]:
    """lm-eval's task manager with pmakit's tasks (built when named) and ``spec.include``; unknown tasks refused."""
    harness.require_lm_eval()
    own = [t for t in spec.tasks if t in TASKS]
    entry = (corpus or corpus_entry(targets)) if own else None
    if entry is not None and snapshot is not None:
        check_tokenizer(entry, snapshot)
    taskset = build_tasks(entry, items=spec.items) if entry is not None else None
    include = [*([taskset.include(spec.split)] if taskset else []), *spec.include]
    manager = harness.task_manager(include, spec.tasks)
    harness.check_tasks(spec.tasks, manager)
    return manager, taskset


def evaluate(
    targets: Sequence[str | Path],
    recipes: Sequence[str],
    spec: Spec,
    *,
    out: Path | None = None,
    corpus: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Evaluate every model of ``targets`` x ``recipes`` (+ the noise band's raw snapshots) on ``spec.tasks``.

    Args:
        out: ``evals.jsonl`` to append rows to and resume from (None: rows only returned).
        corpus: the corpus cache entry pmakit's own tasks are built from (default: the first run's).
        progress: called with a line before each (model, task).

    Returns:
        Every row of the command's models (those read back from ``out`` included), in model then task order.
    """
    version = harness.require_lm_eval()
    models = plan_models(targets, recipes, spec.noise)
    newest = next((m.resolved.snapshots[-1].path if m.resolved else m.path for m in models), None)
    manager, taskset = prepare_tasks(spec, targets, corpus, newest)
    info = taskset.meta["splits"][spec.split] if taskset else {}
    done = _finished(read_jsonl(out) if out else [])
    rows: list[dict[str, Any]] = []
    for m in models:
        base = {"target": m.target, "recipe": m.recipe, **{k: m.key.get(k) for k in ("window", "v", "n")},
                "weights_sha": m.key.get("weights_sha"), "raw_back": m.raw_back, "limit": spec.limit,
                "lm_eval": version}  # fmt: skip
        for task in spec.tasks:
            own = (
                taskset is not None and task in TASKS
            )  # the build (corpus, items) is part of an item's identity
            build = taskset.root.name if own and taskset is not None else None
            key = {**base, "task": task, "split": spec.split if own else None, "build": build}
            if _row_key(key) in done:
                rows += done[_row_key(key)]
                continue
            if progress:
                progress(f"{m.target} {m.recipe}: {task}")
            new = [{**r, "task_info": info.get(task)} for r in _score(m, task, key, manager, spec)]
            if out:
                _append(out, new)
            rows += new
    return rows


def _score(m: Model, task: str, key: dict[str, Any], manager: Any, spec: Spec) -> list[dict[str, Any]]:
    """One (model, task): a row per metric with lm-eval's value and stderr, ours, the items and the time."""
    built = m.build()
    t0 = time.perf_counter()
    lm = harness.hflm(built.model, built.tokenizer, batch_size=spec.batch_size)
    scores = harness.run_tasks(lm, [task], manager, limit=spec.limit).get(task)
    seconds = time.perf_counter() - t0
    if not scores:
        raise PmakitError(f"lm-eval returned no scores for {task} (a group? name its tasks one by one)")
    rows = []
    for metric, s in scores.items():
        value, se = stats.score(metric, s.items) if s.items else (s.value, s.stderr)
        rows.append({**key, "metric": metric, "value": s.value, "se": se, "lm_eval_stderr": s.stderr,
                     "our_value": value, "items_n": len(s.items), "metrics": sorted(scores),
                     "how": built.how, "build_seconds": round(built.seconds, 3), "task_seconds": round(seconds, 3),
                     "doc_ids": s.doc_ids, "items": s.items})  # fmt: skip
    return rows


def _row_key(row: Mapping[str, Any]) -> str:
    return json.dumps([row.get(k) for k in KEY_FIELDS if k != "metric"])


def _finished(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The (model, task)s of ``rows`` with every metric present (a row lists its task's metrics)."""
    groups: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(_row_key(row), {})[str(row.get("metric"))] = row
    return {
        k: [group[m] for m in sorted(group)]
        for k, group in groups.items()
        if set(next(iter(group.values())).get("metrics") or ["?"]) <= set(group)
    }


def _append(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """All of one (model, task)'s rows in one write (a kill tears at most these; they are then redone)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torn = False
    if path.is_file() and path.stat().st_size > 0:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
    with open(path, "a", encoding="utf-8") as f:
        # after a line torn by a kill, a new line: the first row must not be glued to the torn one
        f.write(("\n" if torn else "") + "".join(json.dumps(r) + "\n" for r in rows))
        f.flush()


def summarize(rows: Sequence[dict[str, Any]], reference: str | None = None) -> list[dict[str, Any]]:
    """Per (target, task, metric, model): the score and its s.e., the paired difference to the latest snapshot
    (and to ``reference``: a recipe or a target), and the noise band of the raw snapshots evaluated."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["target"], row["task"], row["metric"]), []).append(row)
    ref_rows = [r for r in rows if reference is not None and reference in (r["recipe"], r["target"])]
    out = []
    for (target, task, metric), group in groups.items():
        latest = next((r for r in group if r["recipe"] == "latest"), None)
        raw = [r["value"] for r in group if r.get("raw_back") is not None]
        band = stats.noise_band(raw) if len(raw) > 1 else None
        ref = next((r for r in ref_rows if r["task"] == task and r["metric"] == metric), None)
        for row in group:
            line = {"target": target, "task": task, "metric": metric, "recipe": row["recipe"],
                    "value": row["value"], "se": row["se"], "items": row["items_n"], "noise": band,
                    "chance": (row.get("task_info") or {}).get("chance") if metric.startswith("acc") else None}  # fmt: skip
            for name, other in (("latest", latest), ("reference", ref)):
                if other is not None and other is not row and row["items"] and other["items"]:
                    line[f"vs_{name}"] = stats.paired(metric, *stats.aligned(row, other)).__dict__
            out.append(line)
    return out


def _delta(d: Mapping[str, Any] | None) -> tuple[str, str]:
    if not d:
        return "", ""
    return f"{d['delta']:+.4f} ± {d['se']:.4f}", f"[{d['low']:+.4f}, {d['high']:+.4f}]"


def render(summary: Sequence[dict[str, Any]]) -> Any:
    """A rich table of ``summarize``'s lines (with the reference's columns when one was named)."""
    from rich.table import Table

    table = Table(title="pmakit eval (s.e. over items; Δ paired on the same items, 95% bootstrap interval)")
    reference = any("vs_reference" in line for line in summary)
    columns = ["target", "model", "task/metric", "score ± s.e.", "Δ vs latest ± s.e.", "95% interval"]
    columns += ["Δ vs reference ± s.e.", "95% interval (ref)"] if reference else []
    for col in [*columns, "noise sd (K)"]:
        table.add_column(col, justify="right" if col[0] in "sΔn9" else "left")
    for line in summary:
        band = line["noise"]
        noise = f"{band['sd']:.4f} ({band['k']})" if band else ""
        chance = f" (chance {line['chance']:.2f})" if line.get("chance") else ""
        cells = [Path(line["target"]).name, line["recipe"], f"{line['task']}/{line['metric']}{chance}",
                 f"{line['value']:.4f} ± {line['se']:.4f}", *_delta(line.get("vs_latest"))]  # fmt: skip
        cells += list(_delta(line.get("vs_reference"))) if reference else []
        table.add_row(*cells, noise)
    return table


def default_output(targets: Sequence[str | Path]) -> Path:
    """RUN/evals.jsonl of the first target that is a run (or study) directory, else ./evals.jsonl."""
    for target in targets:
        path = Path(target)
        if path.is_dir() and ((path / "snapshots").is_dir() or (path / "main").is_dir()):
            return path / EVALS
    return Path(EVALS)


def command(
    targets: Sequence[str | Path],
    recipes: Sequence[str],
    tasks: Sequence[str],
    *,
    output: Path | None,
    reference: str | None,
    include: Sequence[Path],
    corpus_of: Path | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """``pmakit eval``: evaluate, append to the output, print the table; returns the summary lines."""
    from rich.console import Console

    out = output or default_output(targets)
    out = out / EVALS if out.is_dir() or out.suffix != ".jsonl" else out  # a new folder too: `-o results`
    spec = Spec(tasks=tuple(tasks), include=tuple(include), **options)
    err = Console(stderr=True)
    corpus = corpus_entry([corpus_of]) if corpus_of and any(t in TASKS for t in tasks) else None
    rows = evaluate(
        targets, recipes, spec, out=out, corpus=corpus, progress=lambda line: err.print(f"evaluating {line}")
    )
    if reference is not None and Path(reference).exists():
        reference = str(Path(reference).resolve())  # rows name targets by their resolved path
    if reference is not None:  # what `pmakit report` compares with, beside the rows
        atomic_write_text(out.parent / REFERENCE, json.dumps({"reference": reference}) + "\n", fsync=False)
    summary = summarize(rows, reference)
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(render(summary))
    console.print(f"models: {', '.join(sorted({r['how'] for r in rows}))}; rows in {out}")
    return summary
