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

The framework-free part they share is ``pmakit.train.averaging.Averaging`` (also the plain trainer's hook,
re-exported here as ``PMACore``); this module imports neither transformers nor lightning.
Multi-process training: only the main process saves, averages and evaluates (on its own share of the validation
data); the token count is the main process's count times the number of processes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from pmakit.errors import PmakitError
from pmakit.train.averaging import Averaging

__all__ = ["Averaging", "PMACore", "count_tokens", "hf_model_in", "mean_loss"]

PMACore = Averaging
"""The adapters' name for the one averaging hook (``pmakit.train.averaging.Averaging``)."""


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
