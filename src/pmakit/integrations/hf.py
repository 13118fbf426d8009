"""PMA for the HF ``Trainer``: ``trainer = Trainer(..., callbacks=[PMACallback("snapshots", 2_000_000, last=10)])``.

Tokens come from ``state.num_input_tokens_seen`` when the Trainer counts them
(``TrainingArguments(include_num_input_tokens_seen=True)``); otherwise a forward pre-hook counts the elements of
the model's main input (``input_ids``) in every training forward, which is what the Trainer's ``"all"`` count is.
When the Trainer evaluates, the merged weights are swapped in, the eval loss is computed on the Trainer's eval
dataloader, and ``eval_merged_loss`` is added to the evaluation's logged metrics: the console line, the returned
metrics, ``state.log_history`` and metrics.jsonl. Reporters the Trainer registers before user callbacks
(TensorBoard, W&B) get it too once ``callback.attach(trainer)`` has put the callback first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from pmakit.errors import PmakitError
from pmakit.integrations import PMACore, mean_loss


class PMACallback(TrainerCallback):
    """Snapshots every ``every_tokens`` tokens into ``save_dir``, an online ``method`` average of the last
    ``last``, evaluated every ``eval_every``-th evaluation. Other keywords go to ``PMACore`` (alpha, keep_last,
    hold_in_memory, background, dtype, upload_to, buffers)."""

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        every_tokens: int,
        last: int = 10,
        method: str = "sma",
        eval_every: int = 1,
        **options: Any,
    ) -> None:
        self.core = PMACore(
            save_dir, every_tokens, last=last, method=method, eval_every=eval_every, **options
        )
        self.averager = self.core.averager
        self.tokens = 0
        self._hook: Any = None

    def _tokens(self, args: Any, state: Any) -> int:
        if args.include_num_input_tokens_seen not in ("no", False, None):
            return int(state.num_input_tokens_seen)
        return self.tokens * max(1, args.world_size)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        if args.include_num_input_tokens_seen in ("no", False, None) and self._hook is None:
            key = getattr(model, "main_input_name", "input_ids")

            def count(module: Any, inputs: tuple[Any, ...], kw: dict[str, Any]) -> None:
                x = kw.get(key, inputs[0] if inputs else None)
                if module.training and torch.is_grad_enabled() and isinstance(x, torch.Tensor):
                    self.tokens += x.numel()

            self._hook = model.register_forward_pre_hook(count, with_kwargs=True)
            if state.global_step and not self.tokens:
                raise PmakitError(
                    "PMACallback cannot resume the token count of a run that did not track it: "
                    "set TrainingArguments(include_num_input_tokens_seen=True)"
                )
        self.core.start(model, self._tokens(args, state), _tokenizer_files(kwargs, self.core.save_dir))

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        scheduler = kwargs.get("lr_scheduler")
        lr = float(scheduler.get_last_lr()[0]) if scheduler is not None else None
        loss = next((h["loss"] for h in reversed(state.log_history) if "loss" in h), None)
        self.core.step(model, tokens=self._tokens(args, state), step=state.global_step, lr=lr, loss=loss)

    def attach(self, trainer: Any) -> PMACallback:
        """Put this callback first among ``trainer``'s callbacks (adding it if absent), so that the reporters the
        Trainer registers before user callbacks (TensorBoard, W&B, ... from ``report_to``) log the merged loss
        too. Without it the merged loss still reaches the console line, the returned metrics,
        ``state.log_history`` and metrics.jsonl. Returns ``self``."""
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        return self

    def on_log(
        self, args: Any, state: Any, control: Any, logs: Any = None, model: Any = None, **kwargs: Any
    ) -> None:
        """An evaluation's metrics are being logged: score the merged weights on the same eval dataloader and add
        ``<prefix>_merged_loss`` to them, before the console line and any later reporter prints them.

        (The Trainer logs an evaluation's metrics before it calls ``on_evaluate``, so a metric added there never
        reaches a logger; here it does.)"""
        batches = kwargs.get("eval_dataloader")
        prefix = _eval_prefix(logs)
        if not state.is_world_process_zero or model is None or batches is None or prefix is None:
            return
        device = next(model.parameters()).device
        key = getattr(model, "main_input_name", "input_ids")

        def loss_of(batch: Any) -> tuple[torch.Tensor, int]:
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            return model(**batch).loss, len(batch[key])

        tokens = self._tokens(args, state)
        merged = self.core.evaluate(
            model, lambda: mean_loss(model, batches, loss_of), tokens=tokens, step=state.global_step
        )
        if merged is None:
            return
        record = {"kind": "eval", "model": "latest", "tokens": tokens, "step": state.global_step}
        self.core.write({**record, "val_loss": logs[f"{prefix}_loss"]})
        logs[f"{prefix}_merged_loss"] = merged  # also the dict Trainer.evaluate returns
        logs.update(self.core.last_downstream)  # eval_merged/<task>/<metric>, when downstream tasks are given
        entry = state.log_history[-1] if state.log_history else None
        if entry is not None and entry.get(f"{prefix}_loss") == logs[f"{prefix}_loss"]:
            entry[f"{prefix}_merged_loss"] = merged  # the Trainer copied logs into its history just before
            entry.update(self.core.last_downstream)
            entry["merged"] = self.averager.label

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.core.close()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _eval_prefix(logs: Any) -> str | None:
    """``eval`` (or the ``metric_key_prefix`` used) when ``logs`` are an evaluation's metrics, else None."""
    if not isinstance(logs, dict):
        return None
    for k in logs:
        prefix = k[: -len("_loss")]
        # The end-of-training summary (train_loss, train_runtime) has the same shape: not an evaluation.
        if k.endswith("_loss") and f"{prefix}_runtime" in logs and prefix != "train":
            return prefix
    return None


def _tokenizer_files(kwargs: dict[str, Any], save_dir: Path) -> list[Path]:
    """The tokenizer's files (saved once into a hidden folder of save_dir), copied into every snapshot."""
    tokenizer = kwargs.get("processing_class") or kwargs.get("tokenizer")
    if tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
        return []
    folder = save_dir / ".pmakit-tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    return sorted(p for p in folder.iterdir() if p.is_file())
