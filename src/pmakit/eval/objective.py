"""A downstream metric as a per-item loss, for searches that choose a merge (``pmakit tune --metric TASK/METRIC``).

The merge's state is swapped into one model built from the newest snapshot's config; the task's items of the
asked split (``selection`` to choose, ``test`` to report) run through lm-eval, and each item's value becomes a loss
(negated where higher is better), so the mean loss is the metric (or minus it) and paired differences between
candidates are over the same items.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pmakit.errors import PmakitError
from pmakit.eval import harness, model, stats
from pmakit.eval.tasks import SPLITS, build_tasks

HIGHER_IS_BETTER = ("acc", "acc_norm", "exact_match", "f1", "mcc")


def parse_metric(text: str) -> tuple[str, str]:
    """``TASK/METRIC`` -> (task, metric)."""
    task, _, metric = str(text).partition("/")
    if not task or not metric:
        raise PmakitError(
            f"--metric takes TASK/METRIC (pmakit_next_line/acc, pmakit_bpb/bits_per_byte), got {text!r}"
        )
    return task, metric


class Downstream:
    """Per-item losses of merged states on one task/metric, per item split (lm-eval's items, in doc order)."""

    def __init__(self, metric: str, newest: Path, corpus: Path, *, limit: int | None = None) -> None:
        self.task, self.metric = parse_metric(metric)
        self.sign = -1.0 if self.metric in HIGHER_IS_BETTER else 1.0
        self.limit = limit
        tasks = build_tasks(corpus)
        self.managers = {s: harness.task_manager([tasks.include(s)], [self.task]) for s in SPLITS}
        harness.check_tasks([self.task], self.managers["test"])
        self.model = model.load_folder(newest)
        self.tokenizer = model.load_tokenizer(newest)

    def values(self, state: Mapping[str, torch.Tensor], split: str) -> list[float]:
        """The per-item values of the metric for ``state`` on ``split``'s items."""
        params = self.model.state_dict()
        saved = {k: params[k].detach().clone() for k in state if k in params}
        try:
            with torch.no_grad():
                for k in saved:
                    params[k].copy_(state[k])
            lm = harness.hflm(self.model, self.tokenizer)
            scores = harness.run_tasks(lm, [self.task], self.managers[split], limit=self.limit).get(
                self.task, {}
            )
        finally:
            with torch.no_grad():
                for k, v in saved.items():
                    params[k].copy_(v)
        if self.metric not in scores:
            raise PmakitError(
                f"{self.task} has no metric {self.metric!r}; it has {', '.join(sorted(scores)) or 'none'}"
            )
        return stats.item_values(self.metric, scores[self.metric].items)

    def losses(self, state: Mapping[str, torch.Tensor], split: str) -> list[float]:
        return [self.sign * v for v in self.values(state, split)]


def describe(objective: Downstream) -> dict[str, Any]:
    return {
        "metric": f"{objective.task}/{objective.metric}",
        "loss": "minus the metric" if objective.sign < 0 else "the metric",
    }
