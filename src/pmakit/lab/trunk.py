"""A study's training: the constant-LR trunk and the anneal branches off it (the ground truth a merge stands in for).

One copy for the PMA study (``pmakit.lab.pma``: one trunk, a branch at each fork) and the scaling and sweep studies
(a trunk per size or candidate, a branch per budget). Each is resumed: a finished run is not trained again, an
interrupted one continues from its last checkpoint, and a branch starts from the trunk's state kept at its fork.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from pmakit.lab.context import Clock
from pmakit.lab.results import trained_tokens
from pmakit.runs import anneal_run, checkpoint_dir, kept_checkpoint_dir
from pmakit.schedule import WSD
from pmakit.train.loop import TrainConfig, Trainer
from pmakit.units import format_tokens

log = logging.getLogger(__name__)


def log_phase(what: str, done: int, total: int) -> None:
    """``what`` is about to be trained, or ``already done`` when it has reached ``total`` tokens."""
    if done >= total:
        log.info("%s: already done", what)
    else:
        log.info("%s", what)


def train_trunk(
    name: str, cfg: TrainConfig, run_dir: Path, corpus: Any, clock: Clock, progress: bool
) -> None:
    """A study's constant-LR trunk ``run_dir/name/trunk`` (resumed; nothing to do once trained), timed as
    ``name/trunk``."""
    trunk = run_dir / name / "trunk"
    if trained_tokens(trunk) >= cfg.total_tokens:
        return
    log.info("%s: constant-LR trunk to %s tokens", name, format_tokens(cfg.total_tokens))
    t = time.perf_counter()
    trainer = Trainer(cfg, trunk, corpus=corpus, progress=progress)
    try:
        trainer.fit()
    finally:
        trainer.close()
        clock.add(f"{name}/trunk", time.perf_counter() - t)


def anneal_branch(name: str, cfg: TrainConfig, shape: str, budget: int, fork: int, run_dir: Path, corpus: Any,
                  clock: Clock, progress: bool) -> None:  # fmt: skip
    """The budget's ground truth: the trunk's state at the fork, LR decayed to 0 by the budget (``shape``),
    resumed like the trunk, timed as ``name/anneal-budget``."""
    branch = anneal_run(run_dir / name, budget)
    if trained_tokens(branch) >= budget:
        return
    schedule = WSD(cfg.lr, warmup=cfg.warmup_tokens, decay_start=fork, decay_end=budget, shape=shape)
    start = None if checkpoint_dir(branch).exists() else kept_checkpoint_dir(run_dir / name / "trunk", fork)
    branch_cfg = replace(cfg, keep_checkpoints_at=(), total_tokens=budget)
    log.info("%s: anneal from %s to %s", name, format_tokens(fork), format_tokens(budget))
    t = time.perf_counter()
    trainer = Trainer(
        branch_cfg, branch, corpus=corpus, schedule=schedule, resume_from=start, progress=progress
    )
    try:
        trainer.fit(until_tokens=budget)
    finally:
        trainer.close()
        clock.add(f"{name}/anneal-{budget}", time.perf_counter() - t)


def anneal_fork(cfg: TrainConfig, shape: str, fork: int, anneal: int, run_dir: Path, trunk: Path, corpus: Any,
                progress: bool, note: Callable[[int], str] | None = None) -> None:  # fmt: skip
    """The PMA study's branch at ``fork``: ``trunk``'s state kept there, LR decayed to 0 over ``anneal`` tokens
    (``shape``), into ``run_dir``'s anneal run, evaluated about five times along the way (its curve shows the
    anneal's shape). ``note``: the trainer's ``progress_note``."""
    end = fork + anneal
    branch = anneal_run(run_dir, fork)
    schedule = WSD(peak_lr=cfg.lr, warmup=cfg.warmup_tokens, decay_start=fork, decay_end=end, shape=shape)
    resume_from = None if checkpoint_dir(branch).exists() else kept_checkpoint_dir(trunk, fork)
    eval_every = max(1, anneal // cfg.every_tokens // 5)
    branch_cfg = replace(cfg, keep_checkpoints_at=(), total_tokens=end, eval_every=eval_every)
    trainer = Trainer(
        branch_cfg,
        branch,
        corpus=corpus,
        schedule=schedule,
        resume_from=resume_from,
        progress=progress,
        progress_note=note,
    )
    what = f"anneal branch from {format_tokens(fork)} over {format_tokens(anneal)} tokens"
    log_phase(what, trainer.tokens, end)
    try:
        trainer.fit(until_tokens=end)
    finally:
        trainer.close()
