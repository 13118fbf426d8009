"""PMA snapshots during torchtitan training (torchtitan 0.3.0).

torchtitan's ``Trainer`` has no callback hook: its extension point is a subclass (as its own experiments, e.g.
``experiments/torchft``, do). ``PMASnapshots.after_step(trainer)``, called at the end of ``train_step``, saves a
pmakit snapshot every ``every_tokens`` training tokens::

    from torchtitan.config import ConfigManager
    from torchtitan.trainer import Trainer

    from pmakit.integrations.torchtitan import PMASnapshots

    class PMATrainer(Trainer):
        def train_step(self, data_iterator):
            super().train_step(data_iterator)
            self.pma.after_step(self)

    config = ConfigManager().parse_args()          # torchtitan's own command line (--module, --config, ...)
    trainer = PMATrainer(config)                   # in place of torchtitan.train's config.build()
    trainer.pma = PMASnapshots("runs/x-pma", every_tokens=2_000_000)
    trainer.train()
    trainer.pma.close()

- Tokens: torchtitan's own count, ``trainer.ntokens_seen`` (per rank) x the data-parallel degree, the count its
  checkpoints hold (see ``pmakit.layouts.torchtitan``).
- Weights: the full model state in torchtitan's names (the model's own ``state_dict()``, whose hooks split fused
  parameters; torch's ``get_model_state_dict`` cannot follow them), gathered from FSDP shards tensor by tensor
  (``DTensor.full_tensor``, a collective every rank joins) onto rank 0's CPU and written by rank 0's
  ``SnapshotSaver`` (on a background thread). Pipeline parallelism (several model parts) is not supported.
- Resume-safe: torchtitan restores ``step`` and ``ntokens_seen`` from its checkpoint inside ``train()``; at the first
  step after that, the saver starts from the tokens before that step (torchtitan's batches have a fixed shape, so
  the tokens per step are ``ntokens_seen / step``), so a resumed run saves at the same token counts as an
  uninterrupted one (a snapshot the crashed attempt already wrote is written again, with the same step name).

``pmakit merge runs/x-pma -o OUT --format torchtitan`` merges the snapshots into a checkpoint torchtitan loads with
``--checkpoint.initial_load_path OUT --checkpoint.initial_load_model_only``. Keep the snapshots outside torchtitan's
``checkpoint/`` folder. No online average is kept (torchtitan has no evaluation hook to evaluate it with).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pmakit.errors import PmakitError
from pmakit.layouts.base import Snapshot
from pmakit.saver import SnapshotSaver


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def run_tokens(trainer: Any) -> int:
    """torchtitan's training-token count for the whole run: its per-rank ``ntokens_seen`` x the data-parallel
    degree (the data loader's)."""
    return int(trainer.ntokens_seen) * int(getattr(trainer.dataloader, "dp_world_size", 1))


def full_state(model: torch.nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """The model's state dict in torchtitan's names (its own ``state_dict()``: fused parameters split by its hooks),
    FSDP shards gathered tensor by tensor (each a collective every rank joins); CPU copies where ``keep``."""
    out = {}
    for name, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            out[name] = full.detach().to("cpu", copy=True)
    return out


class PMASnapshots:
    """A pmakit snapshot of a torchtitan ``Trainer``'s model every ``every_tokens`` tokens, into ``save_dir``."""

    def __init__(self, save_dir: str | os.PathLike[str], every_tokens: int, **saver_options: Any) -> None:
        if every_tokens < 1:
            raise PmakitError(f"every_tokens must be a positive number of tokens, got {every_tokens}")
        self.save_dir, self.every_tokens, self.saver_options = save_dir, every_tokens, saver_options
        self.saver: SnapshotSaver | None = None
        self._mark: int | None = None
        """Multiples of ``every_tokens`` crossed at the last save or at the start, on every rank."""

    def _start(self, trainer: Any, tokens: int) -> None:
        """At the first step of this process (fresh or resumed): the tokens before it set the first mark."""
        before = tokens - tokens // max(
            int(trainer.step), 1
        )  # fixed-shape batches: the same tokens every step
        self._mark = before // self.every_tokens
        if not _distributed() or dist.get_rank() == 0:
            self.saver = SnapshotSaver(
                self.save_dir, self.every_tokens, start_tokens=before, **self.saver_options
            )

    def after_step(self, trainer: Any) -> Snapshot | None:
        """Call at the end of every ``train_step`` (every rank): saves when a multiple of ``every_tokens`` was
        crossed; the snapshot on rank 0, None elsewhere or when nothing was due."""
        if len(trainer.model_parts) != 1:
            raise PmakitError("PMASnapshots does not support pipeline parallelism (several model parts)")
        tokens = run_tokens(trainer)
        if self._mark is None:
            self._start(trainer, tokens)
        if tokens // self.every_tokens <= (self._mark or 0):  # the same decision on every rank: same counts
            return None
        self._mark = tokens // self.every_tokens
        tensors = full_state(trainer.model_parts[0], keep=self.saver is not None)  # a collective
        if self.saver is None:
            return None
        return self.saver.save(tensors, tokens=tokens, step=int(trainer.step))

    def close(self) -> None:
        """Wait for the snapshot in flight (at the end of training)."""
        if self.saver is not None:
            self.saver.close()
