"""Thin training-framework adapters: ``pmakit.integrations.hf.PMACallback`` (HF Trainer) and
``pmakit.integrations.lightning.PMACallback`` (Lightning), the same constructor for both::

    PMACallback(save_dir, every_tokens, last=10, method="sma", eval_every=1, ...)

Both write snapshots every ``every_tokens`` training tokens under ``save_dir`` in pmakit's format (with the HF
model's config.json, so a snapshot loads with ``from_pretrained``), keep an ``OnlineAverager`` of the last
``last`` snapshots, and when the trainer evaluates (every ``eval_every``-th evaluation) evaluate the merged weights
on the trainer's validation data. Records go to ``save_dir/metrics.jsonl``
(``{"kind": "eval", "model": "merged:sma:10", "tokens", "step", "val_loss"}``).

``pmakit.integrations.olmo_core.PMACallback`` does the same for OLMo-core's ``Trainer`` (a dataclass callback with
the same fields, evaluating with the trainer's own evaluators).

This module holds the framework-free part they share; it imports neither transformers nor lightning.
Multi-process training: only the main process saves, averages and evaluates (on its own share of the validation
data); the token count is the main process's count times the number of processes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pmakit.errors import PmakitError
from pmakit.online import OnlineAverager
from pmakit.saver import SnapshotSaver
from pmakit.snapshot import Snapshot, discover

log = logging.getLogger(__name__)


def hf_model_in(module: nn.Module) -> nn.Module:
    """The outermost HF model (a module with a ``config`` and ``save_pretrained``) inside ``module``, or itself."""
    for sub in module.modules():
        if hasattr(sub, "save_pretrained") and hasattr(getattr(sub, "config", None), "to_json_string"):
            return sub
    return module


def count_tokens(batch: Any, key: str = "input_ids") -> int:
    """Tokens of a batch: the elements of ``batch[key]`` (a mapping), or of its first tensor (a tuple/list/tensor)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, Mapping):
        if key in batch and isinstance(batch[key], torch.Tensor):
            return int(batch[key].numel())
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            if isinstance(item, torch.Tensor):
                return item.numel()
    raise PmakitError(f"cannot count the tokens of a {type(batch).__name__} batch; pass count_tokens=")


class PMACore:
    """Saver + averager + metrics for a callback; the framework adapters feed it tokens, steps and losses."""

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        every_tokens: int,
        *,
        last: int = 10,
        method: str = "sma",
        eval_every: int = 1,
        alpha: float = 0.2,
        keep_last: int | None = None,
        hold_in_memory: bool = False,
        background: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        if eval_every < 0:
            raise PmakitError(f"eval_every must be >= 0 (0: never evaluate the merge), got {eval_every}")
        if keep_last is not None and keep_last < last and not hold_in_memory:
            raise PmakitError(
                f"keep_last={keep_last} < last={last}: the averager reads the window's snapshots back from disk; "
                "keep at least `last` snapshots or pass hold_in_memory=True"
            )
        self.save_dir = Path(save_dir)
        self.every_tokens = every_tokens
        self.eval_every = eval_every
        self.keep_last = keep_last
        self.background = background
        self.dtype = dtype
        self.averager = OnlineAverager(last, method, alpha, hold_in_memory=hold_in_memory)
        self.saver: SnapshotSaver | None = None
        self.evaluations = 0
        self._metrics: Any = None

    def start(self, model: nn.Module, tokens: int, extra_files: list[Path] | None = None) -> None:
        """Set up at the start (or resumption, at ``tokens``) of training; a resumed window is rebuilt from disk."""
        if self.saver is not None:
            return
        text = {}
        config = getattr(model, "config", None)
        if hasattr(config, "to_json_string"):
            text["config.json"] = config.to_json_string()  # type: ignore[union-attr]
        generation = getattr(model, "generation_config", None)
        if hasattr(generation, "to_json_string"):
            text["generation_config.json"] = generation.to_json_string()  # type: ignore[union-attr]
        self.saver = SnapshotSaver(
            self.save_dir,
            self.every_tokens,
            keep_last=self.keep_last,
            background=self.background,
            start_tokens=tokens,
            on_save=[self._on_saved],
            extra_files=extra_files or [],
            extra_text=text,
            dtype=self.dtype,
        )
        if self.averager.count == 0:
            earlier = [s for s in discover(self.save_dir) if s.tokens <= tokens]
            if earlier:
                log.info("resuming the online average from %d snapshots in %s", len(earlier), self.save_dir)
                self.averager.rebuild_from(earlier)

    def _on_saved(self, snapshot: Snapshot, state: dict[str, torch.Tensor]) -> None:
        self.averager.update(state, tokens=snapshot.tokens, path=snapshot.path)

    def step(
        self,
        model: nn.Module | Mapping[str, torch.Tensor],
        *,
        tokens: int,
        step: int,
        lr: float | None = None,
        loss: float | None = None,
    ) -> Snapshot | None:
        """After an optimizer step: save a snapshot of ``model`` (or of its state dict, gathered from shards by the
        adapter) when a multiple of ``every_tokens`` was crossed."""
        if self.saver is None:
            raise PmakitError("PMACallback was not started (no train-begin event)")
        # ``window``: the N of this run's online merge, what `pmakit merge` takes by default from its snapshots.
        snapshot = self.saver.maybe_save(
            model, tokens=tokens, step=step, lr=lr, loss=loss, window=self.averager.n
        )
        if snapshot is not None:
            self.write({"kind": "snapshot", "tokens": tokens, "step": step, "path": str(snapshot.path)})
        return snapshot

    def evaluate(
        self, model: nn.Module, loss_fn: Callable[[], float], *, tokens: int, step: int
    ) -> float | None:
        """Every ``eval_every``-th call: ``loss_fn()`` with the average swapped into ``model``; None otherwise."""
        self.evaluations += 1
        if not self.eval_every or self.evaluations % self.eval_every or self.saver is None:
            return None
        self.saver.wait()  # the snapshot of this very step belongs in the average
        if self.averager.count == 0:
            return None
        with self.averager.swapped_in(model):
            loss = float(loss_fn())
        self.write(
            {
                "kind": "eval",
                "model": self.averager.label,
                "tokens": tokens,
                "step": step,
                "val_loss": loss,
                "n": self.averager.count,
            }
        )
        return loss

    def write(self, record: dict[str, Any]) -> None:
        """Append a record to ``save_dir/metrics.jsonl`` (reopened after ``close``: a trainer may evaluate later)."""
        if self.saver is None:
            return
        if self._metrics is None:
            from pmakit.metrics import MetricsLog

            self._metrics = MetricsLog(self.save_dir, tensorboard=False)
        self._metrics.write(record)

    def close(self) -> None:
        """Flush the snapshot in flight and the metrics file (at the end of training)."""
        if self.saver is not None:
            self.saver.close()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


@torch.no_grad()
def mean_loss(model: nn.Module, batches: Any, loss_of: Callable[[Any], tuple[torch.Tensor, int]]) -> float:
    """The per-sample weighted mean of ``loss_of(batch) -> (mean loss, samples)`` over ``batches``, in eval mode."""
    was_training = model.training
    model.eval()
    try:
        total, samples = 0.0, 0
        for batch in batches:
            loss, n = loss_of(batch)
            total += float(loss) * n
            samples += n
    finally:
        model.train(was_training)
    if samples == 0:
        raise PmakitError("the validation data is empty")
    return total / samples
