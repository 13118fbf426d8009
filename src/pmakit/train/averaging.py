"""The one averaging hook: snapshot saver + online averager + metrics records, for every trainer.

``pmakit.train.loop.Trainer`` and the framework adapters (``pmakit.integrations.hf``, ``.lightning``,
``.olmo_core``) feed an ``Averaging`` tokens, steps and losses; it owns what PMA adds to a training run:

- the ``SnapshotSaver`` (a snapshot every ``every_tokens`` tokens into ``save_dir``),
- the ``OnlineAverager`` (the ``method`` average of the last ``last`` snapshots, fed as each write completes),
- the metrics writer (``snapshot`` and merged ``eval`` records in metrics.jsonl),
- resume (``state_dict`` / ``load_state_dict``, or the window rebuilt from the snapshots on disk),
- when the merge is evaluated (``evaluation_due`` / ``snapshot_evaluation_due``) and how it is swapped into the
  model for that (``swapped_in``, the trained weights restored afterwards).

The trainer knows nothing else about merging (as OLMo-core's ``ModelMergeCallback`` owns its accumulator).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pmakit.errors import PmakitError
from pmakit.layouts.kinds import DEFAULT_BUFFERS
from pmakit.metrics import MetricsLog
from pmakit.online import OnlineAverager
from pmakit.runs import in_run, run_relative
from pmakit.saver import SnapshotSaver
from pmakit.snapshot import Snapshot, discover

log = logging.getLogger(__name__)

PATHS = "relative to the snapshot folder"
"""How ``Averaging.state_dict`` records snapshot paths; a state without this mark kept them as they were given."""


class Averaging:
    """Saver + online averager + metrics of one training run.

    Args:
        save_dir: where the snapshots go.
        every_tokens: V, training tokens between snapshots.
        last: N, snapshots in the online average.
        method: its weighting (see ``pmakit.weights``).
        eval_every: evaluate the merge at every ``eval_every``-th evaluation (or snapshot); 0: never.
        alpha: the EMA factor.
        keep_last: keep only the newest K snapshots on disk (None: all; at least ``last`` unless held in memory).
        hold_in_memory: the averager keeps the window's snapshots instead of reading them back from disk.
        background: write snapshots on a background thread.
        dtype: cast floating-point weights to this dtype in the snapshots.
        metrics: the run's metrics log the records go to (closed by ``close``); None: ``save_dir/metrics.jsonl``,
            opened at the first record and again after ``close`` (a trainer may evaluate after training).
        upload_to: an ``s3://`` / ``gs://`` URL every complete snapshot is also uploaded to, off the training
            thread (``SnapshotSaver``'s ``upload_to``); the callbacks pass it through.
        downstream: lm-eval tasks the merge is also scored on when it is evaluated (``pmakit.eval.harness.
            LoopTasks``: tasks, limit, every); the scores land in the merged record and ``last_downstream``.
        buffers: MoE routers' load-balancing biases averaged (``average``) or the newest snapshot's (``latest``) in
            the online average, as ``pmakit merge --buffers`` does offline.
    """

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
        metrics: MetricsLog | None = None,
        upload_to: str | None = None,
        downstream: Any = None,
        buffers: str = DEFAULT_BUFFERS,
    ) -> None:
        self.downstream = downstream
        self.last_downstream: dict[str, float] = {}
        """``eval_merged/<task>/<metric>`` of the latest merged evaluation that scored them (else empty)."""
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
        self.upload_to = upload_to
        self.averager = OnlineAverager(last, method, alpha, hold_in_memory=hold_in_memory, buffers=buffers)
        self.saver: SnapshotSaver | None = None
        self.evaluations = 0
        """Evaluations counted by ``evaluation_due``."""
        self.step_seconds = 0.0
        """The training thread's wall time in ``step`` (the due check, the copy off the model, the snapshot
        record); where the saver's part of it goes, and the writer thread's CPU: ``saver.timings``."""
        self.metrics = metrics
        self._own_metrics = metrics is None

    # -- start and resume ---------------------------------------------------------------------------------------

    def start(
        self,
        model: nn.Module | None,
        tokens: int,
        extra_files: list[Path] | None = None,
        *,
        rebuild: bool = True,
        writer: bool = True,
    ) -> None:
        """Set up at the start (or resumption, at ``tokens``) of training.

        Args:
            model: an HF model's ``config.json`` and ``generation_config.json`` go into every snapshot (None: no
                config text; the files may come with ``extra_files``).
            extra_files: files copied into every snapshot (config, tokenizer).
            rebuild: an empty window is rebuilt from the snapshots in ``save_dir`` up to ``tokens`` (a restarted
                callback without state); False when the caller restores the window itself (``load_state_dict``).
            writer: this process writes the snapshots; False for a model copy that only keeps the saver's token
                marks (it leaves the directory, and any save in flight there, to the writer).
        """
        if self.saver is not None:
            return
        self.saver = SnapshotSaver(
            self.save_dir,
            self.every_tokens,
            keep_last=self.keep_last,
            background=self.background,
            start_tokens=tokens,
            on_save=[self._on_saved],
            extra_files=extra_files or [],
            extra_text=_config_text(model),
            dtype=self.dtype,
            tidy=writer,
            upload_to=self.upload_to if writer else None,
        )
        if rebuild and self.averager.count == 0:
            earlier = [s for s in discover(self.save_dir) if s.tokens <= tokens]
            if earlier:
                log.info("resuming the online average from %d snapshots in %s", len(earlier), self.save_dir)
                self.averager.rebuild_from(earlier)

    @property
    def started_saver(self) -> SnapshotSaver:
        """The saver, once ``start`` ran."""
        if self.saver is None:
            raise PmakitError("PMACallback was not started (no train-begin event)")
        return self.saver

    def state_dict(self, *, include_tensors: bool | None = None) -> dict[str, Any]:
        """The saver's token marks and the averager's window (empty before ``start``).

        ``include_tensors``: see ``OnlineAverager.state_dict`` (False: plain values only, sums rebuilt from disk).
        """
        if self.saver is None:
            return {}
        # The saver's first: it waits for the write in flight, whose completion adds that snapshot to the window
        # (a checkpoint taken right after a save must hold it, or the resumed window lacks it).
        saver = self.saver.state_dict()
        averager = self.averager.state_dict(include_tensors=include_tensors)
        # Paths relative to the snapshot folder: the run resumes after it is moved or named by another path.
        if saver["last_saved"] is not None:
            saver["last_saved"]["path"] = run_relative(saver["last_saved"]["path"], self.save_dir)
        averager["window"] = [[t, self._recorded(p)] for t, p in averager["window"]]
        return {"saver": saver, "averager": averager, "paths": PATHS}

    def load_state_dict(self, state: Mapping[str, Any], *, window: bool = True) -> None:
        """Continue from ``state`` (after ``start``); ``window=False`` keeps the saver's marks only (a fork starts
        its own online merge). States of older runs, which kept their paths as given, are accepted."""
        as_given = state.get("paths") != PATHS
        saver = dict(state["saver"])
        if saver.get("last_saved"):
            last = saver["last_saved"]
            saver["last_saved"] = {
                **last,
                "path": str(in_run(last["path"], self.save_dir, as_given=as_given)),
            }
        self.started_saver.load_state_dict(saver)
        if window:
            averager = dict(state["averager"])
            averager["window"] = [
                [t, None if p is None else str(in_run(p, self.save_dir, as_given=as_given))]
                for t, p in averager["window"]
            ]
            self.averager.load_state_dict(averager)

    def _recorded(self, path: str | None) -> str | None:
        return None if path is None else run_relative(path, self.save_dir)

    def _on_saved(self, snapshot: Snapshot, state: dict[str, torch.Tensor]) -> None:
        self.averager.update(state, tokens=snapshot.tokens, path=snapshot.path)

    # -- the step -----------------------------------------------------------------------------------------------

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
        start = time.perf_counter()
        # ``window``: the N of this run's online merge, what `pmakit merge` takes by default from its snapshots.
        snapshot = self.started_saver.maybe_save(
            model, tokens=tokens, step=step, lr=lr, loss=loss, window=self.averager.n
        )
        if snapshot is not None:
            path = run_relative(snapshot.path, self._metrics_log().path.parent)  # the log's run, moved or not
            self.write({"kind": "snapshot", "tokens": tokens, "step": step, "path": path})
        self.step_seconds += time.perf_counter() - start
        return snapshot

    # -- evaluating the merge -----------------------------------------------------------------------------------

    def evaluation_due(self) -> bool:
        """Count one evaluation of the trainer's; True at every ``eval_every``-th (the adapters' cadence)."""
        self.evaluations += 1
        return bool(self.eval_every) and self.evaluations % self.eval_every == 0 and self.saver is not None

    def snapshot_evaluation_due(self, tokens: int) -> bool:
        """True at every ``eval_every``-th snapshot mark (the plain trainer's cadence: evaluate at snapshots)."""
        return bool(self.eval_every) and (tokens // self.every_tokens) % self.eval_every == 0

    def merge_ready(self, min_count: int = 1) -> bool:
        """Whether the window holds at least ``min_count`` snapshots, once the one in flight is written (the
        snapshot of this very step belongs in the average)."""
        if self.saver is None:
            return False
        self.saver.wait()
        return self.averager.count >= min_count

    @contextmanager
    def swapped_in(self, model: nn.Module) -> Iterator[nn.Module]:
        """Within the block ``model`` holds the average; its trained weights come back even on error."""
        with self.averager.swapped_in(model) as swapped:
            yield swapped

    def merged_record(self, tokens: int, step: int, values: Mapping[str, Any]) -> dict[str, Any]:
        """The metrics record of an evaluation of the merge: ``model`` is ``merged:<method>:<N>``."""
        base = {"kind": "eval", "tokens": tokens, "step": step}
        return {**base, "model": self.averager.label, "n": self.averager.count, **values}

    def evaluate(
        self, model: nn.Module, loss_fn: Callable[[], float], *, tokens: int, step: int
    ) -> float | None:
        """Every ``eval_every``-th call: ``loss_fn()`` with the average swapped into ``model``; None otherwise."""
        if not self.evaluation_due() or not self.merge_ready():
            return None
        with self.swapped_in(model):
            loss = float(loss_fn())
            due = self.downstream is not None and self.downstream.due()
            self.last_downstream = self.downstream.scores(model) if due else {}
        self.write(self.merged_record(tokens, step, {"val_loss": loss, **self.last_downstream}))
        return loss

    # -- records and the end ------------------------------------------------------------------------------------

    def write(self, record: dict[str, Any]) -> None:
        """Append a record to the metrics log (nothing before ``start``)."""
        if self.saver is None:
            return
        self._metrics_log().write(record)

    def _metrics_log(self) -> MetricsLog:
        if self.metrics is None:
            self.metrics = MetricsLog(self.save_dir, tensorboard=False)
        return self.metrics

    def close(self) -> None:
        """Flush the snapshot in flight and the metrics file (at the end of training)."""
        if self.saver is not None:
            self.saver.close()
        if self.metrics is not None:
            self.metrics.close()
            if self._own_metrics:
                self.metrics = None


def _config_text(model: nn.Module | None) -> dict[str, str]:
    """An HF model's config.json and generation_config.json, as text (so that a snapshot loads with
    ``from_pretrained``); empty for other models."""
    text = {}
    config = getattr(model, "config", None)
    if hasattr(config, "to_json_string"):
        text["config.json"] = config.to_json_string()  # type: ignore[union-attr]
    generation = getattr(model, "generation_config", None)
    if hasattr(generation, "to_json_string"):
        text["generation_config.json"] = generation.to_json_string()  # type: ignore[union-attr]
    return text
