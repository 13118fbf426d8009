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
from dataclasses import dataclass

from pmakit.errors import PmakitError

log = logging.getLogger(__name__)

WeightFn = Callable[..., list[float]]
"""``fn(n, *, alpha) -> n weights``, oldest first, summing to 1."""


@dataclass(frozen=True)
class RunningSums:
    """How a weighting's average of a sliding window is kept up to date without re-reading the window.

    The state is running sums ``S_k = sum_i c_k[i] x_i`` over the window's m snapshots x_1..x_m (oldest first), the
    average is ``factor * S_name``, and adding a snapshot replaces each sum by a linear combination of the old sums
    and of at most three snapshots: ``new`` (the one added), and, once the window is full, ``dropped`` (x_1, which
    leaves) and ``second`` (x_2, the new oldest). ``pmakit.online.OnlineAverager`` applies it; a test checks each
    form against ``coefficients``.
    """

    coefficients: Callable[[int, float], dict[str, list[float]]]
    """(m, alpha) -> sum name -> one coefficient per snapshot of a window of m."""
    average: Callable[[int, float], tuple[str, float]]
    """(m, alpha) -> (sum name, factor): the average of a window of m is factor * that sum."""
    step: Callable[[int, int, float], dict[str, dict[str, float]]]
    """(m, n, alpha) -> sum name -> {term: coefficient} when a snapshot joins a window of m (full when m = n).
    A term is a sum's old value (its own name: a scale of itself), ``new``, ``dropped`` or ``second``. Sums are
    updated in place in this order, so a sum read by another comes after it; terms are applied in their order."""


@dataclass(frozen=True)
class Weighting:
    """A merge weighting and what the rest of pmakit needs to know about it."""

    name: str
    """Its name: ``--method NAME``, the ``method`` of results rows and manifests."""
    fn: WeightFn
    """``fn(n, *, alpha)``: the weights of n snapshots, oldest first, summing to 1."""
    label: str
    """How reports name it (``SMA``, ``WSM 1-sqrt``)."""
    uses_alpha: bool = False
    """Its weights depend on ``--alpha`` (the EMA factor): studies try several, tune searches it."""
    running: RunningSums | None = None
    """The online averager's running sums; None: it recomputes the average from the window at every update."""
    incremental: bool = False
    """When the window moves, the weights of the snapshots that stay keep their ratios, so a previous merge, scaled,
    is reused (``pmakit merge --from-previous``)."""
    tune: bool = True
    """``pmakit tune`` searches it (False where it equals another one)."""

    def __call__(self, n: int, *, alpha: float = 0.2) -> list[float]:
        return self.fn(n, alpha=alpha)


WEIGHTINGS: dict[str, Weighting] = {}
"""The registry, in the order the CLI lists and the reports show them."""


def register(
    name: str,
    *,
    label: str | None = None,
    uses_alpha: bool = False,
    running: RunningSums | None = None,
    incremental: bool = False,
    tune: bool = True,
) -> Callable[[WeightFn], WeightFn]:
    """Register the weighting ``fn(n, *, alpha)`` under ``name``: usable as ``--method name``, online, in
    ``--from-previous`` updates (with ``incremental``), tune and reports, with nothing else to edit."""

    def wrap(fn: WeightFn) -> WeightFn:
        if name == "custom" or not name or name in WEIGHTINGS:
            raise PmakitError(f"weighting name {name!r} is taken or reserved")
        WEIGHTINGS[name] = Weighting(name, fn, label or name.upper(), uses_alpha, running, incremental, tune)
        return fn

    return wrap


def unregister(name: str) -> None:
    """Remove a registered weighting (for tests and plugins that register one for a while)."""
    WEIGHTINGS.pop(name, None)


def weighting(name: str) -> Weighting:
    """The registered weighting ``name``; an unknown name fails listing the known ones."""
    try:
        return WEIGHTINGS[name]
    except KeyError:
        raise PmakitError(f"unknown method {name!r}; known: {', '.join([*WEIGHTINGS, 'custom'])}") from None


def uses_alpha(name: str) -> bool:
    """``name`` is a registered weighting whose weights depend on alpha."""
    w = WEIGHTINGS.get(name)
    return w is not None and w.uses_alpha


def tune_families() -> tuple[str, ...]:
    """The weightings ``pmakit tune`` searches, in registry order."""
    return tuple(w.name for w in WEIGHTINGS.values() if w.tune)


# ------------------------------------------------------------------------------------------------- running sums


def _full(m: int, n: int, terms: dict[str, float]) -> dict[str, float]:
    """``terms`` once the window is full (m = n), else nothing."""
    return terms if m == n else {}


SMA_SUMS = RunningSums(
    coefficients=lambda m, a: {"sum": [1.0] * m},
    average=lambda m, a: ("sum", 1.0 / m),
    step=lambda m, n, a: {"sum": {"new": 1.0, **_full(m, n, {"dropped": -1.0})}},
)
"""S = sum x_i; slide S += x_new - x_1."""

WMA_SUMS = RunningSums(
    coefficients=lambda m, a: {"sum": [1.0] * m, "wsum": [float(i) for i in range(1, m + 1)]},
    average=lambda m, a: ("wsum", 2.0 / (m * (m + 1))),
    step=lambda m, n, a: {
        "wsum": {"sum": -1.0, "new": float(n)} if m == n else {"new": float(m + 1)},
        "sum": {"new": 1.0, **_full(m, n, {"dropped": -1.0})},
    },
)
"""S = sum x_i, W = sum i x_i; slide W += n x_new - S, then S += x_new - x_1."""

EMA_SUMS = RunningSums(
    coefficients=lambda m, a: {"avg": ema(m, alpha=a)},
    average=lambda m, a: ("avg", 1.0),
    step=lambda m, n, a: {
        "avg": {"avg": 1 - a, "new": a, **_full(m, n, {"dropped": -((1 - a) ** n), "second": (1 - a) ** n})}
    },
)
"""E = the seeded EMA itself; slide E = (1-a)E + a x_new - (1-a)^n x_1 + (1-a)^n x_2."""

EMA_NORMALIZED_SUMS = RunningSums(
    coefficients=lambda m, a: {"u": [a * (1 - a) ** (m - i) for i in range(1, m + 1)]},
    average=lambda m, a: ("u", 1.0 / (1.0 - (1.0 - a) ** m)),
    step=lambda m, n, a: {"u": {"u": 1 - a, "new": a, **_full(m, n, {"dropped": -a * (1 - a) ** n})}},
)
"""U = sum a(1-a)^(m-i) x_i; slide U = (1-a)U + a x_new - a(1-a)^n x_1."""


# ------------------------------------------------------------------------------------------------- the weightings


@register("sma", label="SMA", running=SMA_SUMS, incremental=True)
def sma(n: int, *, alpha: float = 0.2) -> list[float]:
    return [1.0 / n] * n


@register("wma", label="WMA", running=WMA_SUMS)
def wma(n: int, *, alpha: float = 0.2) -> list[float]:
    total = n * (n + 1) / 2
    return [i / total for i in range(1, n + 1)]


@register("ema", label="EMA", uses_alpha=True, running=EMA_SUMS, incremental=True)
def ema(n: int, *, alpha: float = 0.2) -> list[float]:
    return [(1 - alpha) ** (n - 1)] + [alpha * (1 - alpha) ** (n - i) for i in range(2, n + 1)]


@register("ema-normalized", label="EMA-norm", uses_alpha=True, running=EMA_NORMALIZED_SUMS, incremental=True)
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
    register(
        f"wsm-{_shape}",
        label="WSM " + _shape.replace("1sqrt", "1-sqrt"),
        tune=_shape != "linear",  # wsm-linear equals sma
    )(lambda n, *, alpha=0.2, _s=_shape: wsm_weights(n, _s))


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
    w = weighting(method)
    if not 0 < alpha <= 1:
        raise PmakitError(f"--alpha must be in (0, 1], got {alpha}")
    return w(n, alpha=alpha)


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
