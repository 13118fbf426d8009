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
    RUN/curves.csv             held-out loss vs tokens and vs all-reduces of every arm (the online evaluations)
    RUN/experiment.json        ``"study": "replicas"``, the config, seconds per arm
Re-running resumes: a finished arm is not trained again, an interrupted one resumes from its checkpoint.
"""

from __future__ import annotations

import csv
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

import pmakit
from pmakit.config import AT_LEAST_2, check_fields, from_mapping
from pmakit.errors import PmakitError
from pmakit.evaluate import EvalResult, paired_difference
from pmakit.lab.context import utc_now
from pmakit.lab.scoring import SplitScorer
from pmakit.report.schema import REPLICAS_COLUMNS, REPLICAS_CURVE_COLUMNS
from pmakit.runs import atomic_open, atomic_write_text, checkpoint_dir, replica_dir, snapshots_dir
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
    if _trained_tokens(arm_dir) >= train.total_tokens:
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


def _previous_seconds(run_dir: Path) -> dict[str, float]:
    """Seconds per arm recorded by an earlier invocation (a resumed study keeps its arms' training times)."""
    try:
        return dict(json.loads((run_dir / "experiment.json").read_text())["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _trained_tokens(arm_dir: Path) -> int:
    """Tokens of the arm's final checkpoint (0 when it has none yet)."""
    try:
        return int(json.loads((checkpoint_dir(arm_dir) / "pmakit.json").read_text())["tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


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


def _score_arm(scorer: SplitScorer, run_dir: Path, arm: Arm, study: ReplicaStudy) -> dict[str, EvalResult]:
    """Latest, PMA over time, and (with per-copy snapshots) PMA over copies and time."""
    from pmakit.formats import read_state
    from pmakit.merge import average_states

    snaps = _snapshots(snapshots_dir(run_dir / "arms" / arm.name))
    if len(snaps) < study.last:
        raise PmakitError(
            f"arm {arm.name} has {len(snaps)} snapshots, fewer than replicas.last = {study.last}"
        )
    window = [read_state(p) for p in snaps[-study.last :]]
    out = {
        "latest": scorer(window[-1], "val"),
        f"pma{study.last}": scorer(average_states(window, [1 / study.last] * study.last), "val"),
    }
    copies = [
        _snapshots(snapshots_dir(replica_dir(run_dir / "arms" / arm.name, r))) for r in range(arm.replicas)
    ]
    if arm.sync.save_replicas and all(len(c) >= study.last for c in copies):
        states = [read_state(p) for c in copies for p in c[-study.last :]]
        out[f"pma{study.last}-copies"] = scorer(
            average_states(states, [1 / len(states)] * len(states)), "val"
        )
    return out


def _rows(scores: dict[str, dict[str, EvalResult]], arms: Sequence[Arm], train: Any) -> list[dict[str, Any]]:
    """One row per (arm, model), with differences paired against the sync arm's model of the same kind and the
    single copy's."""
    steps = {
        a.name: train.total_tokens // (train.tokens_per_step * (1 if a.replicas == 1 else a.replicas))
        for a in arms
    }
    rows = []
    for arm in arms:
        for model, result in scores[arm.name].items():
            kind = model.replace("-copies", "")
            row: dict[str, Any] = {
                "arm": arm.name,
                "model": model,
                "tokens": train.total_tokens,
                "all_reduces": arm.all_reduces(steps[arm.name]),
                "val_loss": result.loss,
                "val_loss_se": result.loss_se,
                "bpb": result.bpb,
                "batch_losses": result.batch_losses,
            }
            for ref in ("sync", "single"):
                d, se = paired_difference(result, scores[ref][kind])
                row[f"delta_vs_{ref}"], row[f"delta_vs_{ref}_se"] = d, se
            rows.append(row)
    return rows


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
    with atomic_open(run_dir / f"{name}.csv") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


RESULT_COLUMNS = REPLICAS_COLUMNS
CURVE_COLUMNS = REPLICAS_CURVE_COLUMNS


def run_study(
    data: Mapping[str, Any], run_dir: str | Path, *, fresh: bool = False, progress: bool = True
) -> Path:
    """Run (or resume) the study into ``run_dir``; returns the report's path."""
    train, study = resolve(data)
    run_dir = Path(run_dir)
    if fresh and (run_dir / "arms").exists():
        import shutil

        shutil.rmtree(run_dir / "arms")
    run_dir.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    previous = _previous_seconds(run_dir)
    seconds = {
        arm.name: _run_arm(run_dir, train, arm, study) or previous.get(arm.name, 0.0) for arm in study.arms
    }
    t = time.perf_counter()
    scorer = _scorer(train, study)
    scores = {arm.name: _score_arm(scorer, run_dir, arm, study) for arm in study.arms}
    seconds["evaluation"] = time.perf_counter() - t
    _write(run_dir, "results", _rows(scores, study.arms, train), RESULT_COLUMNS)
    _write(run_dir, "curves", _curves(run_dir, study.arms), CURVE_COLUMNS)
    record = {
        "study": STUDY,
        "preset": data.get("preset"),
        "config": {"train": train.to_dict(), STUDY: asdict(study)},
        "seconds": seconds,
        "started": started,
        "pmakit": pmakit.__version__,
        "load_average": os.getloadavg(),
    }
    atomic_write_text(run_dir / "experiment.json", json.dumps(record, indent=1, default=str) + "\n")
    from pmakit.report import write_report

    paths = write_report(run_dir)
    return Path(getattr(paths, "html", run_dir / "report.html"))
