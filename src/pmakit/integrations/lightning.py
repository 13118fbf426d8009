"""PMA for Lightning: ``lightning.Trainer(callbacks=[PMACallback("snapshots", 2_000_000, last=10)])``.

Tokens are counted from each training batch (``batch["input_ids"]``, or the first tensor of a tuple) times the
number of processes; a snapshot is considered after each optimizer step. When the HF model inside the
LightningModule is found (a submodule with ``config`` and ``save_pretrained``), that is what is saved, so a
snapshot loads with ``from_pretrained``; otherwise the whole LightningModule's state dict is saved. After each
validation the merged weights are evaluated on the trainer's validation dataloaders and logged as
``val_merged_loss``. The callback's state (tokens, saver) travels in Lightning checkpoints.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from pmakit.errors import PmakitError
from pmakit.integrations import PMACore, count_tokens, hf_model_in, mean_loss


class PMACallback(pl.Callback):
    """Snapshots every ``every_tokens`` tokens into ``save_dir``, an online ``method`` average of the last
    ``last``, evaluated every ``eval_every``-th validation. ``count_tokens(batch) -> int`` overrides the count;
    other keywords go to ``PMACore`` (alpha, keep_last, hold_in_memory, background, dtype, upload_to, buffers)."""

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        every_tokens: int,
        last: int = 10,
        method: str = "sma",
        eval_every: int = 1,
        count_tokens: Callable[[Any], int] = count_tokens,
        **options: Any,
    ) -> None:
        self.core = PMACore(
            save_dir, every_tokens, last=last, method=method, eval_every=eval_every, **options
        )
        self.averager = self.core.averager
        self.count_tokens = count_tokens
        self.tokens = 0
        self._merged: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:  # after a checkpoint restore, so self.tokens is the resumed count
            self.core.start(hf_model_in(pl_module), self.tokens)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.tokens += self.count_tokens(batch) * trainer.world_size
        stepped = (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or trainer.fit_loop.epoch_loop.done
        if trainer.is_global_zero and stepped:
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None
            self.core.step(
                hf_model_in(pl_module),
                tokens=self.tokens,
                step=trainer.global_step,
                lr=lr,
                loss=float(loss) if isinstance(loss, torch.Tensor) else None,
            )

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        model = hf_model_in(pl_module)
        loaders = trainer.val_dataloaders
        loaders = [loaders] if not isinstance(loaders, (list, tuple)) else loaders

        def loss_of(batch: Any) -> tuple[torch.Tensor, int]:
            batch = move_data_to_device(batch, pl_module.device)
            n = len(batch["input_ids"]) if isinstance(batch, Mapping) and "input_ids" in batch else 1
            if model is not pl_module and isinstance(batch, Mapping):
                return model(**batch).loss, n
            with _no_logging(pl_module):  # the module's validation_step logs "val_loss": not for the merge
                out = pl_module.validation_step(batch, 0)
            loss = out["loss"] if isinstance(out, Mapping) else out
            if not isinstance(loss, torch.Tensor):
                raise PmakitError("validation_step must return the loss (a tensor, or a dict with 'loss')")
            return loss, n

        self._merged = self.core.evaluate(
            model,
            lambda: mean_loss(pl_module, (b for loader in loaders for b in loader), loss_of),
            tokens=self.tokens,
            step=trainer.global_step,
        )
        if self._merged is not None:
            pl_module.log("val_merged_loss", self._merged, rank_zero_only=True)
            for name, value in self.core.last_downstream.items():
                pl_module.log(name, value, rank_zero_only=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        latest = trainer.callback_metrics.get("val_loss")
        if self._merged is not None and latest is not None:
            record = {"kind": "eval", "model": "latest", "tokens": self.tokens, "step": trainer.global_step}
            self.core.write({**record, "val_loss": float(latest)})
        self._merged = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.core.close()

    def state_dict(self) -> dict[str, Any]:
        # Enough to resume: the saver restarts at the next multiple above these tokens and the window is rebuilt
        # from the snapshots on disk.
        return {"tokens": self.tokens}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tokens = int(state_dict["tokens"])


@contextlib.contextmanager
def _no_logging(module: pl.LightningModule) -> Iterator[None]:
    module.log = module.log_dict = lambda *a, **k: None  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del module.log, module.log_dict  # the instance attributes go; the class's methods show again
