"""Hooks into ``pmakit train``'s loop: every method optional (empty by default), as OLMo-core's callbacks.

A leaf of the trainer: spike recovery (``pmakit.train.spike_recovery``) and the studies subclass ``Callback`` without importing
the loop itself.
"""

from __future__ import annotations

from typing import Any

# ``trainer`` is a ``pmakit.train.loop.Trainer``; typed Any so that this leaf imports nothing of the loop.
Trainer = Any


class Callback:
    """Hooks into the loop; every method is optional (empty by default)."""

    def on_train_start(self, trainer: Trainer) -> None:
        """After set-up (and after resuming), before the first step."""

    def on_step_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """After every optimizer step; ``record`` has tokens, step, loss, grad_norm, lr."""

    def on_snapshot(self, trainer: Trainer, snapshot: Any) -> None:
        """After a snapshot was taken (its CPU copy exists; the write may still be in flight)."""

    def on_eval(self, trainer: Trainer, records: list[dict[str, Any]]) -> None:
        """After latest and merged weights were evaluated."""

    def on_train_end(self, trainer: Trainer) -> None:
        """After the last step, snapshots flushed."""


class StopTraining(Exception):
    """Raised by a callback to end the run cleanly (the final state is saved)."""
