"""pmakit: Pre-trained Model Averaging for LLM pre-training.

Save weight snapshots every V tokens, merge the last N of them (SMA, WMA, EMA, WSM weightings) into a model that
predicts, or replaces, what annealing the learning rate would give.

``import pmakit`` is light: the names below are loaded on first use, so that importing pmakit (any module of it)
before torch sets up the environment (``OMP_WAIT_POLICY=PASSIVE`` unless set: see ``pmakit._env``) in time.
"""

from __future__ import annotations

import importlib
from typing import Any

from pmakit import _env  # noqa: F401  (first: before anything imports torch)

__version__ = "0.1.0"

_EXPORTS = {
    "PmakitError": "pmakit.errors",
    # snapshots in
    "Snapshot": "pmakit.snapshot",
    "discover": "pmakit.snapshot",
    "read_snapshot": "pmakit.snapshot",
    "write_metadata": "pmakit.snapshot",
    "inspect_inputs": "pmakit.survey",
    "select_snapshots": "pmakit.selection",
    "select_for_merge": "pmakit.selection",
    # weightings and the tensor policy
    "WEIGHTINGS": "pmakit.weights",
    "Weighting": "pmakit.weights",
    "get_weights": "pmakit.weights",
    "TensorPolicy": "pmakit.layouts.kinds",
    # merging
    "merge": "pmakit.merge",
    "plan_merge": "pmakit.merge",
    "MergePlan": "pmakit.merge",
    "MergeResult": "pmakit.merge",
    "average_states": "pmakit.merge",
    # a user's own training loop
    "SnapshotSaver": "pmakit.saver",
    "OnlineAverager": "pmakit.online",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pmakit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
