"""Numbers a team can trust: each score with its standard error over items, paired differences, the noise band.

Every metric is a ratio of sums over items, R = sum(a_i) / sum(b_i), shown as f(R):

- a mean metric (``acc``, ``acc_norm``, any per-item score): a_i the item's value, b_i = 1, f(R) = R;
- ``bits_per_byte``: a_i the item's log-likelihood (nats), b_i its bytes, f(R) = -R / ln 2;
- ``byte_perplexity`` / ``word_perplexity``: the same pairs (bytes / words), f(R) = exp(-R);
- ``loss`` (``pmakit_loss``): log-likelihood and tokens, f(R) = -R (nats per token).

Standard errors are over items (the delta method: z_i = (a_i - R b_i) / mean(b), se(R) = sd(z) / sqrt(n), times
|f'(R)|); for a mean metric that is the textbook sd / sqrt(n). Two models scored on the same items differ by
f(R_A) - f(R_B), with the paired standard error of the per-item linearised differences (for a mean metric:
sd(x_A - x_B) / sqrt(n)) and a 95% percentile bootstrap interval that resamples the items (the same resample for
both models). The noise band is the spread of the K newest raw snapshots' scores: what one checkpoint's score moves
from save to save, against which a merge's gain over the latest snapshot is read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pmakit.errors import PmakitError

BOOTSTRAP = 2000
"""Bootstrap resamples of the items."""
RATIO_UNITS = {"bits_per_byte", "byte_perplexity", "word_perplexity", "loss"}


@dataclass(frozen=True)
class Paired:
    """A - B on the same items."""

    delta: float
    se: float
    low: float
    """2.5th percentile of the bootstrap differences."""
    high: float
    """97.5th percentile."""
    items: int


def _pairs(metric: str, items: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    if metric in RATIO_UNITS:
        arr = np.asarray(items, dtype=np.float64).reshape(-1, 2)
        return arr[:, 0], arr[:, 1]
    values = np.asarray(items, dtype=np.float64).reshape(-1)
    return values, np.ones_like(values)


def _f(metric: str, r: np.ndarray | float) -> Any:
    if metric == "bits_per_byte":
        return -np.asarray(r) / math.log(2)
    if metric == "loss":
        return -np.asarray(r)
    if metric in RATIO_UNITS:
        return np.exp(-np.asarray(r))
    return np.asarray(r)


def _df(metric: str, r: float) -> float:
    if metric == "bits_per_byte":
        return -1 / math.log(2)
    if metric == "loss":
        return -1.0
    if metric in RATIO_UNITS:
        return -math.exp(-r)
    return 1.0


def _linearised(metric: str, items: Sequence[Any]) -> tuple[float, np.ndarray]:
    """f(R) and each item's influence on it (f'(R) z_i): the mean of these is 0, their sd / sqrt(n) the s.e."""
    a, b = _pairs(metric, items)
    if len(a) == 0 or b.sum() <= 0:
        raise PmakitError(f"{metric}: no items to score")
    r = a.sum() / b.sum()
    return float(_f(metric, r)), _df(metric, r) * (a - r * b) / b.mean()


def _se(x: np.ndarray) -> float:
    return float(np.std(x, ddof=1) / math.sqrt(len(x))) if len(x) > 1 else math.nan


def score(metric: str, items: Sequence[Any]) -> tuple[float, float]:
    """(value, standard error over items) of ``metric`` from its per-item values."""
    value, influence = _linearised(metric, items)
    return value, _se(influence)


def paired(metric: str, a: Sequence[Any], b: Sequence[Any], *, seed: int = 0) -> Paired:
    """A - B on the same items (in the same order): difference, paired s.e., 95% bootstrap interval."""
    if len(a) != len(b):
        raise PmakitError(
            f"{metric}: a paired difference needs both models on the same items ({len(a)} vs {len(b)})"
        )
    va, ia = _linearised(metric, a)
    vb, ib = _linearised(metric, b)
    (na, da), (nb, db) = _pairs(metric, a), _pairs(metric, b)
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(len(na), np.full(len(na), 1 / len(na)), size=BOOTSTRAP).astype(np.float64)
    boot = _f(metric, counts @ na / (counts @ da)) - _f(metric, counts @ nb / (counts @ db))
    low, high = np.nanpercentile(boot, [2.5, 97.5])
    return Paired(va - vb, _se(ia - ib), float(low), float(high), len(na))


def aligned(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """Two rows' per-item values on the items both scored (matched by doc id), in doc order."""
    ia = dict(zip(a["doc_ids"], a["items"]))
    ib = dict(zip(b["doc_ids"], b["items"]))
    common = sorted(ia.keys() & ib.keys())
    return [ia[d] for d in common], [ib[d] for d in common]


def noise_band(values: Sequence[float]) -> dict[str, float | int]:
    """The spread of raw snapshots' scores: sample sd, min, max, and how many (K)."""
    xs = [float(v) for v in values]
    sd = float(np.std(xs, ddof=1)) if len(xs) > 1 else math.nan
    return {"sd": sd, "min": min(xs), "max": max(xs), "k": len(xs)}


def item_values(metric: str, items: Sequence[Any]) -> list[float]:
    """Per-item values whose mean is the metric (f(R) + each item's linearised influence): what a search that
    averages per-item scores (``pmakit tune --metric``) can race and choose on."""
    value, influence = _linearised(metric, items)
    return [value + float(x) for x in influence]
