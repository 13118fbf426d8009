"""Loss-spike recovery during training: the ``SpikeRecovery`` callback of ``pmakit.train.loop``.

On a spike its ``SpikeDetector`` reports, it rolls the weights back onto the merge of the last K snapshots saved
before the spike began (``pmakit.recover``: the detector, the rollback choice and the in-memory merge, which the
offline ``pmakit recover`` shares) and goes on.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import shutil
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError
from pmakit.recover import (
    DISCARDED_DIR,
    OPTIMIZER_POLICIES,
    Spike,
    SpikeConfig,
    SpikeDetector,
    choose_rollback,
    latest_optimizer_checkpoint,
    merged_state,
    spike_boundary,
)
from pmakit.runs import run_relative
from pmakit.snapshot import Snapshot
from pmakit.train.callbacks import Callback, StopTraining
from pmakit.units import format_tokens

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryConfig:
    """What ``SpikeRecovery`` does when the detector fires."""

    detector: SpikeConfig = field(default_factory=SpikeConfig)
    """When a run of steps counts as a spike (``warmup_tokens`` 0 takes the trainer's LR warmup)."""
    last: int = 3
    """K: merge the last K snapshots saved before the spike began."""
    method: str = "sma"
    """Weighting of the K snapshots (``pmakit.weights``)."""
    alpha: float = 0.2
    """EMA factor for ema weightings."""
    optimizer: str = "reset"
    """``reset`` (fresh AdamW moments) or ``keep-latest`` (the optimizer state of the newest pre-spike snapshot)."""
    lr_factor: float = 1.0
    """Multiply the scheduled LR by this after a recovery (1: resume as scheduled)."""
    lr_factor_tokens: int = 0
    """For this many tokens after a recovery."""
    max_recoveries: int = 3
    """Stop the run with a clear message at the spike after this many recoveries, rather than loop."""
    discard_spiked: bool = True
    """Move snapshots saved at or after the spike's boundary out of the snapshot folder (into RUN/discarded/), so
    that no later merge picks them up."""
    keep_optimizer_states: int = 4
    """With ``keep-latest``: optimizer states kept in CPU memory, one per recent snapshot (2 x model size each)."""

    def __post_init__(self) -> None:
        from pmakit.weights import get_weights

        if self.last < 1 or self.max_recoveries < 0 or self.keep_optimizer_states < 1:
            raise PmakitError("recovery last and keep_optimizer_states must be >= 1, max_recoveries >= 0")
        if self.optimizer not in OPTIMIZER_POLICIES:
            raise PmakitError(
                f"unknown optimizer policy {self.optimizer!r}; use {' or '.join(OPTIMIZER_POLICIES)}"
            )
        if not (math.isfinite(self.lr_factor) and self.lr_factor > 0) or self.lr_factor_tokens < 0:
            raise PmakitError("recovery lr_factor must be positive and lr_factor_tokens non-negative")
        get_weights(self.method, self.last, alpha=self.alpha)  # validates method and alpha


class SpikeRecovery(Callback):
    """A ``pmakit.train.loop`` callback: on a loss spike, roll the weights back onto the merge of the last K
    snapshots saved before the spike began, and go on.

    Per recovery: an ``event: spike`` record, then the trainer's ``event: rollback`` record carrying what was
    merged (paths, tokens, weights), the optimizer policy and where its state came from, and the snapshots
    discarded. The token count does not go back (the trainer continues from where it stopped, on fresh data), so
    later snapshots land at the next multiples of V as before; the online merge is rebuilt from the pre-spike
    snapshots. After ``max_recoveries`` (counted across resumes) the next spike stops the run with a clear message.

    Fewer than K snapshots before the spike (early in a run, or a saver ``keep_last`` that already removed older
    ones: keep it above K plus the snapshots a detection delay can add) merges what there is; none stops the run.
    """

    def __init__(self, config: RecoveryConfig | None = None) -> None:
        self.config = config or RecoveryConfig()
        self.detector = SpikeDetector(self.config.detector)
        self.events: list[dict[str, Any]] = []
        """The rollback reasons of this process, oldest first (also in RUN/metrics.jsonl)."""
        self._optimizer_states: deque[tuple[int, dict[str, Any]]] = deque(
            maxlen=self.config.keep_optimizer_states
        )

    def on_train_start(self, trainer: Any) -> None:
        detector = self.config.detector
        warmup = getattr(trainer.config, "warmup_tokens", 0)
        if detector.warmup_tokens == 0 and warmup:
            detector = dataclasses.replace(detector, warmup_tokens=warmup)
        self.detector = SpikeDetector(detector)  # a resumed run starts a fresh baseline

    def on_snapshot(self, trainer: Any, snapshot: Any) -> None:
        if self.config.optimizer == "keep-latest":
            self._optimizer_states.append((snapshot.tokens, copy.deepcopy(trainer.optimizer.state_dict())))

    def on_step_end(self, trainer: Any, record: dict[str, Any]) -> None:
        grad = record.get("grad_norm")
        spike = self.detector.update(
            int(record["tokens"]),
            float(record["loss"]),
            None if grad is None else float(grad),
            step=record.get("step"),
        )
        if spike is not None:
            self.recover(trainer, spike)

    def recover(self, trainer: Any, spike: Spike) -> dict[str, Any]:
        """Roll ``trainer`` back from ``spike``; returns the reason recorded with the rollback event.

        Raises:
            StopTraining: after ``max_recoveries``, or when there is nothing to roll back to.
        """
        cfg = self.config
        done = int(getattr(trainer.state, "recoveries", len(self.events)))
        self._record_spike(trainer, spike, done)
        trainer.saver.wait()  # snapshots in flight must be complete (or failed) before choosing among them
        from pmakit.snapshot import discover

        snapshots = discover(trainer.saver.directory)
        before = spike_boundary(spike, trainer.config.tokens_per_step)
        try:
            chosen = choose_rollback(snapshots, before, cfg.last, allow_fewer=True)
        except PmakitError as e:
            raise StopTraining(f"{spike.describe()}; cannot recover: {e}") from None
        optimizer, opt_tokens = self._optimizer_for(trainer, before, snapshots)
        state, weights = merged_state(chosen, cfg.method, cfg.alpha)
        discarded = self._discard(trainer, snapshots, before, spike) if cfg.discard_spiked else []
        run = (
            trainer.run_dir
        )  # the event goes to its metrics.jsonl: paths relative to the run, as it may move
        reason = {
            "recovery": done + 1,
            "spike": spike.to_dict(),
            "before_tokens": before,
            "method": cfg.method,
            "merged": [
                {"path": run_relative(s.path, run), "step": s.step, "tokens": s.tokens, "weight": w}
                for s, w in zip(chosen, weights)
            ],
            "optimizer_policy": cfg.optimizer,
            "optimizer_from_tokens": opt_tokens,
            "discarded": [run_relative(p, run) for p in discarded],
        }
        if cfg.lr_factor != 1.0 and cfg.lr_factor_tokens > 0:
            until = trainer.tokens + cfg.lr_factor_tokens
            trainer.set_lr_factor(cfg.lr_factor, until)
            reason.update(lr_factor=cfg.lr_factor, lr_factor_until=until)
        trainer.rollback(state, optimizer=optimizer, reason=reason)
        # The online merge must not average the spiked snapshots with what comes next.
        kept = [s for s in snapshots if s.tokens < before]
        trainer.averager.rebuild_from(kept)
        self.detector.rewind(spike.start_tokens)
        self.events.append(reason)
        log.warning(
            "rolled back onto the %s of %d snapshot(s) at %s tokens (optimizer: %s)",
            cfg.method,
            len(chosen),
            ", ".join(format_tokens(s.tokens) for s in chosen),
            cfg.optimizer,
        )
        return reason

    def _record_spike(self, trainer: Any, spike: Spike, done: int) -> None:
        """The spike as an event in the run's metrics and a warning; past ``max_recoveries`` the run stops."""
        cfg = self.config
        trainer.metrics.write(
            {
                "kind": "event",
                "event": "spike",
                "tokens": trainer.tokens,
                "step": trainer.step,
                **spike.to_dict(),
            }
        )
        log.warning("%s", spike.describe())
        if done >= cfg.max_recoveries:
            raise StopTraining(
                f"{spike.describe()}; {done} recoveries already (max_recoveries={cfg.max_recoveries}): the run "
                "does not stay on track at this learning rate; lower it, or allow more recoveries"
            )

    def _optimizer_for(
        self, trainer: Any, before: int, snapshots: Sequence[Snapshot]
    ) -> tuple[str | dict[str, Any], int | None]:
        """``reset``, or the newest pre-spike optimizer state (kept in memory, else from a full checkpoint)."""
        if self.config.optimizer == "reset":
            return "reset", None
        in_memory = [(t, s) for t, s in self._optimizer_states if t < before]
        on_disk = latest_optimizer_checkpoint(Path(trainer.run_dir), snapshots, before)
        if in_memory and (on_disk is None or in_memory[-1][0] >= on_disk.tokens):
            return copy.deepcopy(in_memory[-1][1]), in_memory[-1][0]
        if on_disk is not None:
            import torch

            return torch.load(on_disk.path / "optimizer.pt", weights_only=True), on_disk.tokens
        raise StopTraining(
            f"optimizer keep-latest: no optimizer state before {format_tokens(before)} tokens (in memory: "
            f"{[t for t, _ in self._optimizer_states]}; none in the run's checkpoints); use optimizer reset"
        )

    def _discard(self, trainer: Any, snapshots: Sequence[Snapshot], before: int, spike: Spike) -> list[Path]:
        spiked = [s for s in snapshots if s.tokens >= before]
        if not spiked:
            return []
        # Three levels below RUN: `pmakit merge RUN` (which looks two levels down) never sees them.
        target = Path(trainer.run_dir) / DISCARDED_DIR / f"spike-{spike.start_tokens}"
        target.mkdir(parents=True, exist_ok=True)
        moved = []
        for s in spiked:
            dest = target / s.path.name
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(s.path, dest)
            moved.append(dest)
        return moved
