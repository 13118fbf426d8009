"""The ``replicas`` study (``pmakit experiment --preset replicas``): model copies kept together by synchronous data
parallel, local SGD and DiLoCo, with PMA on top of each.

Every arm trains the same model on the same number of tokens per step: R copies of ``batch_size`` sequences under
torchrun (``pmakit train --replicas R``), or one copy of R x ``batch_size`` sequences (``single``, the single-copy
reference). Each arm snapshots its (synced) model every V tokens; V is a multiple of every arm's sync interval, so
every snapshot is of the synced model. At the end every arm is scored on the same held-out batches: its latest
weights, PMA (the SMA of its last N snapshots) and, for arms that keep per-copy snapshots, PMA across copies and
time (the SMA of every copy's own weights at the last N syncs). Differences are paired over the batches.

Run directory:
    RUN/arms/NAME/             each arm's run (``pmakit train`` layout: snapshots/, metrics.jsonl, checkpoint/)
    RUN/results.jsonl|.csv     one row per (arm, model): loss, s.e., all-reduces, paired differences
    RUN/curves.jsonl|.csv      held-out loss vs tokens and vs all-reduces of every arm (the online evaluations)
    RUN/config.json            the config stamp: a changed config is refused without --fresh
    RUN/timings.json           seconds per arm and of the evaluation, summed over invocations
    RUN/experiment.json        ``"study": "replicas"``, the config, seconds per arm
Re-running resumes: a finished arm is not trained again, an interrupted one resumes from its checkpoint, a scored
model is not scored again. ``--fresh`` removes the arms and their scores (``FRESH_CLEARS``), nothing else.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pmakit.config import AT_LEAST_2, check_fields, from_mapping
from pmakit.errors import PmakitError
from pmakit.evaluate import EvalResult, paired_difference
from pmakit.lab.context import StudyRun, jsonable, open_run
from pmakit.lab.results import ResultRows, trained_tokens, write_csv
from pmakit.lab.scoring import SplitScorer
from pmakit.report.schema import REPLICAS_COLUMNS, REPLICAS_CURVE_COLUMNS
from pmakit.runs import (
    RESULTS,
    RESULTS_CSV,
    atomic_write_json,
    atomic_write_text,
    replica_dir,
    snapshots_dir,
)
from pmakit.train.replicas import ReplicaConfig

log = logging.getLogger(__name__)
STUDY = "replicas"


@dataclass(frozen=True)
class Arm:
    """One way of training: how many copies and how they are kept together."""

    name: str
    """Directory name and label."""
    replicas: int = 2
    """Model copies (1: a single copy with ``replicas`` x the batch; see ``ReplicaStudy.replicas``)."""
    sync: ReplicaConfig = field(default_factory=ReplicaConfig)
    """How the copies are kept together: the options of ``pmakit train --replicas``."""

    def args(self) -> list[str]:
        """The ``pmakit train`` options of this arm."""
        if self.replicas == 1:
            return []
        c = self.sync
        out = ["--replicas", str(self.replicas), "--sync", c.sync]
        if c.sync == "weights":
            out += ["--sync-every", str(c.sync_every), "--outer", c.outer]
            out += ["--outer-lr", str(c.outer_lr), "--outer-momentum", str(c.outer_momentum)]
        return out + (["--save-replicas"] if c.save_replicas else [])

    def all_reduces(self, step: int) -> int:
        """All-reduces (syncs) after ``step`` optimizer steps."""
        if self.replicas == 1:
            return 0
        return step if self.sync.sync == "gradients" else step // self.sync.sync_every


@dataclass(frozen=True)
class ReplicaStudy:
    """The ``replicas:`` section of the preset."""

    replicas: Annotated[int, AT_LEAST_2] = 2
    """R: model copies of the multi-copy arms (processes under torchrun)."""
    arms: tuple[Arm, ...] = field(default_factory=tuple)
    """The arms; ``sync`` (synchronous data parallel) is the reference of the paired differences."""
    last: Annotated[int, AT_LEAST_2] = 4
    """N of the PMA: the SMA of each arm's last N snapshots."""
    eval_batches: Annotated[int, AT_LEAST_2] = 16
    """Held-out batches of the final scores (the same for every arm)."""

    def __post_init__(self) -> None:
        check_fields(self, STUDY)  # the bounds declared above
        names = [a.name for a in self.arms]
        if "sync" not in names or "single" not in names:
            raise PmakitError("the replicas study needs the arms 'sync' (reference) and 'single'")
        if len(set(names)) != len(names):
            raise PmakitError(f"arm names must be unique: {names}")


def resolve(data: Mapping[str, Any]) -> tuple[Any, ReplicaStudy]:
    """The train config and the study of a preset's mapping; unknown keys are an error naming them."""
    from pmakit.train.loop import TrainConfig

    section = data.get(STUDY) or {}
    if not isinstance(section, Mapping):
        raise PmakitError(f"the {STUDY} config must be a mapping of keys to values, got {section!r}")
    section = dict(section)
    replicas = section.get("replicas", ReplicaStudy.replicas)
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise PmakitError(f"{STUDY}.replicas: expected a whole number, got {replicas!r}")
    arms = []
    for item in section.pop("arms", None) or ():
        if not isinstance(item, Mapping):
            raise PmakitError(f"{STUDY}.arms: each arm is a mapping with a name, got {item!r}")
        options = dict(item)
        name = str(options.pop("name", ""))
        sync = from_mapping(ReplicaConfig, options, f"{STUDY}.arms.{name}") if name != "single" else None
        arms.append(Arm(name, 1) if sync is None else Arm(name, replicas, sync))
    study = from_mapping(ReplicaStudy, {**section, "arms": tuple(arms)}, STUDY)
    return TrainConfig.from_dict(dict(data.get("train") or {})), study


def _arm_config(train: Any, arm: Arm, study: ReplicaStudy) -> dict[str, Any]:
    """The arm's ``train:`` section: the single copy takes all copies' sequences in one batch."""
    cfg = train.to_dict()
    if arm.replicas == 1:
        cfg["batch_size"] = train.batch_size * study.replicas
    cfg["keep_last"] = None
    return {"train": cfg}


def _run_arm(run_dir: Path, train: Any, arm: Arm, study: ReplicaStudy) -> float:
    """Train (or resume) one arm in a subprocess; returns its wall seconds."""
    import yaml

    arm_dir = run_dir / "arms" / arm.name
    if trained_tokens(arm_dir) >= train.total_tokens:
        log.info("arm %s: already trained", arm.name)
        return 0.0
    arm_dir.mkdir(parents=True, exist_ok=True)
    config = arm_dir.parent / f"{arm.name}.yaml"
    config.write_text(yaml.safe_dump(_arm_config(train, arm, study), sort_keys=False))
    cmd = [sys.executable, "-m", "pmakit", "train", str(config), "-o", str(arm_dir), *arm.args()]
    log.info("arm %s: pmakit train %s", arm.name, " ".join(cmd[4:]))
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    t = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise PmakitError(f"arm {arm.name} failed (exit {done.returncode}): {tail[0]}")
    return time.perf_counter() - t


def _snapshots(directory: Path) -> list[Path]:
    from pmakit.snapshot import discover

    return [s.path for s in discover(directory)] if directory.is_dir() else []


def _scorer(train: Any, study: ReplicaStudy) -> SplitScorer:
    """One model (every state scored is swapped into it) on the fixed held-out batches (split ``val``)."""
    from pmakit.train.data import val_batches
    from pmakit.train.loop import load_corpus

    corpus = load_corpus(train)
    batches = val_batches(
        corpus.val, batch_size=train.batch_size, seq_len=train.model.seq_len, max_batches=study.eval_batches
    )
    return SplitScorer.build(train.model, corpus, {"val": batches})


def _to_score(run_dir: Path, arm: Arm, study: ReplicaStudy, rows: ResultRows) -> dict[str, list[Path]]:
    """The arm's models not scored yet, each the snapshots it averages: latest, PMA over time, and (with per-copy
    snapshots) PMA over copies and time."""
    arm_dir = run_dir / "arms" / arm.name
    snaps = _snapshots(snapshots_dir(arm_dir))
    if len(snaps) < study.last:
        raise PmakitError(
            f"arm {arm.name} has {len(snaps)} snapshots, fewer than replicas.last = {study.last}"
        )
    models = {"latest": snaps[-1:], f"pma{study.last}": snaps[-study.last :]}
    copies = [_snapshots(snapshots_dir(replica_dir(arm_dir, r))) for r in range(arm.replicas)]
    if arm.sync.save_replicas and all(len(c) >= study.last for c in copies):
        models[f"pma{study.last}-copies"] = [p for c in copies for p in c[-study.last :]]
    return {model: paths for model, paths in models.items() if (arm.name, model) not in rows}


def _score(scorer: SplitScorer, paths: Sequence[Path]) -> EvalResult:
    """The SMA of the snapshots at ``paths`` (one: the snapshot itself) on the held-out batches."""
    from pmakit.formats import read_state
    from pmakit.merge import average_states

    states = [read_state(p) for p in paths]
    return scorer(
        states[0] if len(states) == 1 else average_states(states, [1 / len(states)] * len(states)), "val"
    )


def _score_arms(run: StudyRun, train: Any, study: ReplicaStudy, rows: ResultRows) -> None:
    """Score every arm's models not scored by an earlier invocation, one row each (appended as measured)."""
    todo = [(arm, _to_score(run.dir, arm, study, rows)) for arm in study.arms]
    if not any(models for _, models in todo):
        return
    t = time.perf_counter()
    scorer = _scorer(train, study)
    for arm, models in todo:
        steps = train.total_tokens // (train.tokens_per_step * (1 if arm.replicas == 1 else arm.replicas))
        for model, paths in models.items():
            result = _score(scorer, paths)
            row = {
                "arm": arm.name,
                "model": model,
                "tokens": train.total_tokens,
                "all_reduces": arm.all_reduces(steps),
            }
            rows.add({**row, **result.as_record(), "batch_losses": result.batch_losses})
    run.clock.add("evaluation", time.perf_counter() - t)


def _paired(rows: Sequence[dict[str, Any]], arms: Sequence[Arm]) -> list[dict[str, Any]]:
    """The rows in the arms' order, each with its differences paired against the sync arm's model of the same kind
    and the single copy's."""
    by = {(r["arm"], r["model"]): r for r in rows}
    out = [r for arm in arms for (name, _), r in by.items() if name == arm.name]
    for row in out:
        result = _result(row)
        kind = row["model"].replace("-copies", "")
        for ref in ("sync", "single"):
            d, se = paired_difference(result, _result(by[(ref, kind)]))
            row[f"delta_vs_{ref}"], row[f"delta_vs_{ref}_se"] = d, se
    return out


def _result(row: Mapping[str, Any]) -> EvalResult:
    return EvalResult(row["val_loss"], row["val_loss_se"], row["bpb"], row["batch_losses"])


def _curves(run_dir: Path, arms: Sequence[Arm]) -> list[dict[str, Any]]:
    """The online evaluations of every arm (latest and its online merge) against tokens and all-reduces."""
    from pmakit.metrics import read_metrics

    out = []
    for arm in arms:
        for r in read_metrics(run_dir / "arms" / arm.name):
            if r.get("kind") == "eval":
                out.append(
                    {
                        "arm": arm.name,
                        "model": "latest" if r["model"] == "latest" else "merged",
                        "tokens": r["tokens"],
                        "all_reduces": arm.all_reduces(int(r["step"])),
                        "val_loss": r["val_loss"],
                        "val_loss_se": r.get("val_loss_se"),
                    }
                )
    return out


def _write(run_dir: Path, name: str, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    atomic_write_text(run_dir / f"{name}.jsonl", "".join(json.dumps(dict(r)) + "\n" for r in rows))
    write_csv(run_dir / f"{name}.csv", columns, rows)


RESULT_COLUMNS = REPLICAS_COLUMNS
CURVE_COLUMNS = REPLICAS_CURVE_COLUMNS
FRESH_CLEARS = ("arms", RESULTS, RESULTS_CSV, "curves.jsonl", "curves.csv")
"""What --fresh removes: the arms (trained again) and the scores of them; the rest of RUN is rewritten at the end,
and a directory of this study from before the config stamp has nothing to tell the study's files from others."""


def run_study(
    data: Mapping[str, Any], run_dir: str | Path, *, fresh: bool = False, progress: bool = True
) -> Path:
    """Run (or resume) the study into ``run_dir``; returns the report's path."""
    train, study = resolve(data)
    config = jsonable({"train": train.to_dict(), STUDY: asdict(study)})
    run = open_run(run_dir, config, fresh=fresh, clears=FRESH_CLEARS)
    for arm in study.arms:
        run.clock.add(arm.name, _run_arm(run.dir, train, arm, study))
    rows = ResultRows(run.dir / RESULTS, _key)
    _score_arms(run, train, study, rows)
    _write(run.dir, "results", _paired(rows.rows, study.arms), RESULT_COLUMNS)
    _write(run.dir, "curves", _curves(run.dir, study.arms), CURVE_COLUMNS)
    record = {
        "study": STUDY,
        "preset": data.get("preset"),
        "config": config,
        "seconds": dict(run.clock.seconds),
        **run.stamp(),
    }
    atomic_write_json(run.dir / "experiment.json", record)
    from pmakit.report import write_report

    paths = write_report(run.dir)
    return Path(getattr(paths, "html", run.dir / "report.html"))


def _key(row: Mapping[str, Any]) -> tuple[str, str]:
    return row["arm"], row["model"]
