"""Merge weightings: pure functions from a snapshot count to weights, oldest snapshot first.

Every weighting returns N floats, index 0 the oldest snapshot, index N-1 the newest, summing to 1. One streaming
accumulator (`pmakit.merge`) applies any of them. Definitions, i = 1..N oldest first:

- ``sma``: w_i = 1/N.
- ``wma``: w_i = i / (N(N+1)/2), newest heaviest.
- ``ema``: the recursion M = alpha*M_i + (1-alpha)*M seeded with M = M_1, i.e.
  w_1 = (1-alpha)^(N-1) and w_i = alpha*(1-alpha)^(N-i) for i >= 2. Sums to 1 exactly.
- ``ema-normalized``: w_i proportional to alpha*(1-alpha)^(N-i) (the paper's closed form, renormalised). Unlike
  ``ema`` the oldest snapshot does not carry the seed's extra mass.
- ``wsm-SHAPE`` (WSM, arXiv 2507.17634): a merge is a decay schedule in disguise. With decay shape f on [0, 1]
  (linear 1-x, cosine (1+cos(pi x))/2, 1sqrt 1-sqrt(x)) the gradient weights are g_j = f(j/N), j = 1..N-1, and the
  merge weights c_1 = 1-g_1, c_{j+1} = g_j - g_{j+1}, c_N = g_{N-1}. ``wsm-linear`` equals ``sma``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

from pmakit.errors import PmakitError

log = logging.getLogger(__name__)

Weighting = Callable[..., list[float]]
WEIGHTINGS: dict[str, Weighting] = {}


def register(name: str) -> Callable[[Weighting], Weighting]:
    """Register a weighting under ``name`` (used as ``--method name``)."""

    def wrap(fn: Weighting) -> Weighting:
        WEIGHTINGS[name] = fn
        return fn

    return wrap


@register("sma")
def sma(n: int, *, alpha: float = 0.2) -> list[float]:
    return [1.0 / n] * n


@register("wma")
def wma(n: int, *, alpha: float = 0.2) -> list[float]:
    total = n * (n + 1) / 2
    return [i / total for i in range(1, n + 1)]


@register("ema")
def ema(n: int, *, alpha: float = 0.2) -> list[float]:
    return [(1 - alpha) ** (n - 1)] + [alpha * (1 - alpha) ** (n - i) for i in range(2, n + 1)]


@register("ema-normalized")
def ema_normalized(n: int, *, alpha: float = 0.2) -> list[float]:
    raw = [alpha * (1 - alpha) ** (n - i) for i in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda x: 1.0 - x,
    "cosine": lambda x: (1.0 + math.cos(math.pi * x)) / 2.0,
    "1sqrt": lambda x: 1.0 - math.sqrt(x),
}


def wsm_weights(n: int, shape: str) -> list[float]:
    """Merge weights equivalent to decaying the LR with ``shape`` over the window (WSM)."""
    if n == 1:
        return [1.0]
    f = DECAY_SHAPES[shape]
    g = [f(j / n) for j in range(1, n)]  # g[0] is g_1
    return [1.0 - g[0]] + [g[j] - g[j + 1] for j in range(n - 2)] + [g[-1]]


for _shape in DECAY_SHAPES:
    register(f"wsm-{_shape}")(lambda n, *, alpha=0.2, _s=_shape: wsm_weights(n, _s))


def get_weights(
    method: str, n: int, *, alpha: float = 0.2, custom: Sequence[float] | None = None
) -> list[float]:
    """Weights for ``n`` snapshots, oldest first.

    Args:
        method: a registered name (see ``WEIGHTINGS``) or ``custom``.
        alpha: the EMA factor, in (0, 1].
        custom: with ``method="custom"``, one weight per snapshot, oldest first. Weights that do not sum to 1 are
            normalised (with a warning): a merge that scales the model is never what averaging means.
    """
    if n < 1:
        raise PmakitError("a merge needs at least one snapshot")
    if method == "custom" or custom is not None:
        return normalize_custom(custom or [], n)
    if method not in WEIGHTINGS:
        raise PmakitError(f"unknown method {method!r}; known: {', '.join([*WEIGHTINGS, 'custom'])}")
    if not 0 < alpha <= 1:
        raise PmakitError(f"--alpha must be in (0, 1], got {alpha}")
    return WEIGHTINGS[method](n, alpha=alpha)


def normalize_custom(weights: Sequence[float], n: int) -> list[float]:
    """Check user weights against the snapshot count and normalise them to sum 1."""
    if len(weights) != n:
        raise PmakitError(
            f"--weights gives {len(weights)} weights for {n} chosen snapshots; give one per snapshot"
        )
    if any(not math.isfinite(w) for w in weights):
        raise PmakitError(f"--weights must be finite numbers, got {list(weights)}")
    try:
        total = math.fsum(weights)
    except OverflowError:
        total = math.inf
    if not math.isfinite(total):
        raise PmakitError(f"--weights sum overflows ({list(weights)}); give weights of a sensible size")
    if any(w < 0 for w in weights):
        log.warning(
            "--weights has negative weights %s: the merge extrapolates rather than averages", list(weights)
        )
    if total <= 0:
        raise PmakitError(f"--weights must have a positive sum, got {total:g}")
    if abs(total - 1) > 1e-6:
        log.warning("--weights sum to %g; normalised to sum 1", total)
    return [w / total for w in weights]
