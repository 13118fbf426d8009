"""Fit the Chinchilla law ``L(N, D) = E + A/N^alpha + B/D^beta`` to measured losses, with bootstrap error bars.

The method of Hoffmann et al. 2022 (approach 3) as replicated by Besiroglu et al. 2024: minimise the Huber loss
(delta 1e-3) between the predicted and the measured log-loss, with the law written as
``log L = logsumexp(a - alpha log N, b - beta log D, e)`` (A = exp a, B = exp b, E = exp e), from the best points of
a grid of initial values; error bars by refitting on resampled points. The minimiser is scipy's L-BFGS-B (as in
Hoffmann et al.) with the analytic gradient and tolerances near machine precision: Besiroglu et al. traced the
original's implausibly narrow intervals to an optimiser stopped early, so convergence is checked, never assumed.

Used twice: by ``pmakit scaling-fit`` on any results file (a user's own runs) and by the report of the ``scaling``
study (``pmakit experiment --preset scaling``), which fits merges and anneals separately and predicts a held-out
model size with both, and the law's floor at each size: the least error any law of this form can have there, which
says when a target is out of reach of every fit. A leaf module: numpy and scipy only.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np

from pmakit.errors import PmakitError
from pmakit.limits import RESULTS_BYTES, SCALING_POINTS, loads_json, read_regular, refuse

KINDS = ("merge", "anneal")
PARAMS = ("E", "A", "B", "alpha", "beta")
HUBER_DELTA = 1e-3
"""Hoffmann et al.'s delta: residuals are log-losses, so 1e-3 is a 0.1% miss (quadratic below, linear above)."""

# The grid of initial values (Hoffmann et al.: alpha, beta in 0..2, e in -1..1.5, a, b in 0..25). The whole grid is
# scored in one vectorised pass and the minimiser starts from the best few: the objective is cheap, the fits are not.
_GRID = {
    "e": np.linspace(-1.0, 1.5, 6),
    "a": np.linspace(0.0, 25.0, 6),
    "b": np.linspace(0.0, 25.0, 6),
    "alpha": np.linspace(0.0, 2.0, 5),
    "beta": np.linspace(0.0, 2.0, 5),
}
_GRID_CHUNK = 256
_BOOTSTRAP_CHUNK = 100
"""Resamples scored on the grid at once: 5,400 x 100 doubles (4 MB) per chunk of points."""
_LOWER = np.array([-10.0, -20.0, -20.0, 0.0, 0.0])
_UPPER = np.array([10.0, 80.0, 80.0, 4.0, 4.0])


@dataclass(frozen=True)
class Point:
    """One measured loss."""

    n: float
    """Model size N (non-embedding parameters, by the study's convention)."""
    d: float
    """Training tokens D."""
    loss: float
    """Held-out loss (nats per token)."""
    kind: str
    """merge or anneal: what produced the loss."""


@dataclass(frozen=True)
class Law:
    """``L(N, D) = E + A/N^alpha + B/D^beta``."""

    E: float
    """Irreducible loss."""
    A: float
    """Size term's scale."""
    B: float
    """Data term's scale."""
    alpha: float
    """Size exponent."""
    beta: float
    """Data exponent."""

    @classmethod
    def from_theta(cls, theta: Sequence[float] | np.ndarray) -> Law:
        e, a, b, alpha, beta = (float(x) for x in theta)
        return cls(math.exp(e), math.exp(a), math.exp(b), alpha, beta)

    def __call__(self, n: Any, d: Any) -> Any:
        return self.E + self.A / np.power(n, self.alpha) + self.B / np.power(d, self.beta)

    def frontier(self, compute: Any, n_grid: Any) -> Any:
        """The compute-optimal loss at each compute C = 6ND: the least L(N, C/6N) over ``n_grid``."""
        c = np.asarray(compute, dtype=float)[:, None]
        n = np.asarray(n_grid, dtype=float)[None, :]
        return np.min(self(n, c / (6.0 * n)), axis=1)


@dataclass(frozen=True)
class Fit:
    """One kind's fit: the law, its 95% bootstrap intervals and how well it converged."""

    law: Law
    """The point estimate (all fitting points)."""
    ci95: dict[str, tuple[float, float]]
    """2.5 and 97.5 percentiles of each parameter over the bootstrap refits."""
    points: int
    """Points fitted."""
    sizes: list[float]
    """Distinct N among them."""
    huber: float
    """The objective at the optimum (sum of Huber losses of log residuals)."""
    rms_log_residual: float
    """Root mean square of log(L_pred / L_measured) at the optimum."""
    bootstrap: int
    """Resamples that gave a fit (failed ones are counted in ``bootstrap_failed``)."""
    bootstrap_failed: int = 0
    """Resamples where every start failed (degenerate resamples); left out of the intervals."""
    samples: list[list[float]] = field(default_factory=list, repr=False)
    """The bootstrap refits as (E, A, B, alpha, beta) rows, for prediction intervals."""
    at_bound: list[str] = field(default_factory=list)
    """Parameters the optimum puts on a bound of the search box: the data do not pin them down."""

    def predict_interval(self, n: float, d: float) -> tuple[float, float]:
        """2.5 and 97.5 percentiles of the bootstrap laws' predictions at (n, d)."""
        if not self.samples:
            return (math.nan, math.nan)
        s = np.asarray(self.samples)
        pred = s[:, 0] + s[:, 1] / n ** s[:, 3] + s[:, 2] / d ** s[:, 4]
        lo, hi = np.percentile(pred, [2.5, 97.5])
        return float(lo), float(hi)


# --------------------------------------------------------------------------------------------------- the fit


def _log_pred(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log L(N, D) and the softmax weights of its three terms (the Jacobian's building blocks)."""
    e, a, b, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    top = terms.max(axis=0)
    w = np.exp(terms - top)
    total = w.sum(axis=0)
    return top + np.log(total), w / total


def _residuals(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray) -> np.ndarray:
    return _log_pred(theta, log_n, log_d)[0] - log_l


def _jacobian(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray) -> np.ndarray:
    _, (wa, wb, we) = _log_pred(theta, log_n, log_d)
    return np.stack([we, wa, wb, -wa * log_n, -wb * log_d], axis=1)


def _huber_each(r: np.ndarray, delta: float) -> np.ndarray:
    """Huber loss of each residual."""
    a = np.abs(r)
    return np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))


def _grid_scores(
    log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray, counts: np.ndarray, delta: float
) -> np.ndarray:
    """The objective at every grid point for each column of ``counts`` (how often each point is taken: ones for
    the fit, a resample's multiplicities for a bootstrap refit): grid points x columns.

    The per-point losses do not depend on the resample, so all the bootstrap's grids cost one pass over the points
    and one product (was one pass per resample: 95% of a 4,500-point bootstrap's time).
    """
    grid = _grid()
    e, a, b, alpha, beta = (grid[:, i : i + 1] for i in range(5))
    score = np.zeros((len(grid), counts.shape[1]))
    # Points in chunks: the grid times every point at once would be 5,400 x N doubles per array (21 GB at 200k).
    for lo in range(0, len(log_n), _GRID_CHUNK):
        n_, d_, l_ = (x[None, lo : lo + _GRID_CHUNK] for x in (log_n, log_d, log_l))
        r = np.logaddexp(np.logaddexp(a - alpha * n_, b - beta * d_), e) - l_
        score += _huber_each(r, delta) @ counts[lo : lo + _GRID_CHUNK]
    return score


def _grid() -> np.ndarray:
    return np.array(list(product(*_GRID.values())))  # columns e, a, b, alpha, beta


def _grid_starts(
    log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray, keep: int, delta: float
) -> np.ndarray:
    """The ``keep`` grid points with the lowest objective, best first."""
    score = _grid_scores(log_n, log_d, log_l, np.ones((len(log_n), 1)), delta)[:, 0]
    return _grid()[np.argsort(score, kind="stable")[:keep]]


def _objective(
    theta: np.ndarray,
    log_n: np.ndarray,
    log_d: np.ndarray,
    log_l: np.ndarray,
    delta: float,
    weight: np.ndarray | None = None,
) -> tuple[float, np.ndarray]:
    """The summed Huber loss of the log residuals (each point counted ``weight`` times) and its gradient."""
    pred, (wa, wb, we) = _log_pred(theta, log_n, log_d)  # once for the value and the gradient: the hot path
    r = pred - log_l
    small = np.abs(r) <= delta
    loss = np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta))
    psi = np.where(small, r, delta * np.sign(r))
    if weight is not None:
        loss, psi = loss * weight, psi * weight
    jac = np.stack([we, wa, wb, -wa * log_n, -wb * log_d], axis=1)
    return float(loss.sum()), jac.T @ psi


def _minimise(
    starts: Iterable[np.ndarray],
    log_n: np.ndarray,
    log_d: np.ndarray,
    log_l: np.ndarray,
    delta: float,
    weight: np.ndarray | None = None,
) -> tuple[np.ndarray, float] | None:
    """The best local optimum over ``starts`` (None when no start converged)."""
    from scipy.optimize import minimize
    from threadpoolctl import threadpool_limits

    best: tuple[np.ndarray, float] | None = None
    # One BLAS thread: L-BFGS-B's products are 5 x 20, and on a busy machine more threads only wait for each other
    # at every one of them (a fit of 48 points: 40 s with two OpenBLAS threads at load 20, 3.7 s with one).
    with threadpool_limits(limits=1, user_api="blas"):
        for x0 in starts:
            res = minimize(
                _objective,
                np.clip(x0, _LOWER, _UPPER),
                args=(log_n, log_d, log_l, delta, weight),
                jac=True,
                method="L-BFGS-B",
                bounds=list(zip(_LOWER, _UPPER)),
                # Tolerances near machine precision: the objective is ~1e-6 at the optimum, so scipy's defaults
                # would stop far from it (the flaw Besiroglu et al. found in the original fit).
                options={"maxiter": 5000, "ftol": 1e-15, "gtol": 1e-12, "maxcor": 20},
            )
            if not res.success or not np.all(np.isfinite(res.x)):
                continue  # not converged: never report an optimiser that stopped early
            if best is None or res.fun < best[1]:
                best = (res.x, float(res.fun))
    return best


def _logs(points: Sequence[Point]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    arr = np.array([(p.n, p.d, p.loss) for p in points], dtype=float)
    return np.log(arr[:, 0]), np.log(arr[:, 1]), np.log(arr[:, 2])


def fit_law(points: Sequence[Point], *, delta: float = HUBER_DELTA, starts: int = 24) -> tuple[Law, float]:
    """The least-Huber law through ``points`` (the best of ``starts`` grid starts) and its objective."""
    _check_fittable(points)
    log_n, log_d, log_l = _logs(points)
    best = _minimise(_grid_starts(log_n, log_d, log_l, starts, delta), log_n, log_d, log_l, delta)
    if best is None:
        raise PmakitError(f"the scaling-law fit did not converge from any of {starts} starting points")
    return Law.from_theta(best[0]), best[1]


def _check_fittable(points: Sequence[Point]) -> None:
    if len(points) < 6:
        raise PmakitError(
            f"a scaling-law fit has 5 parameters and needs at least 6 points, got {len(points)}"
        )
    if len({p.n for p in points}) < 2 or len({p.d for p in points}) < 2:
        raise PmakitError("a scaling-law fit needs at least 2 model sizes and 2 token counts")


def _theta(law: Law) -> np.ndarray:
    return np.array([math.log(law.E), math.log(law.A), math.log(law.B), law.alpha, law.beta])


def fit(points: Sequence[Point], *, bootstrap: int = 400, seed: int = 0, delta: float = HUBER_DELTA) -> Fit:
    """Fit ``points`` and bootstrap it: ``bootstrap`` refits on points resampled with replacement.

    Each refit starts from the full fit's optimum and from the best grid points of the resample, so a resample
    whose optimum lies elsewhere is not pulled towards the point estimate.
    """
    law, value = fit_law(points, delta=delta)
    log_n, log_d, log_l = _logs(points)
    rng = np.random.default_rng(seed)
    counts: list[np.ndarray] = []
    failed = 0
    for _ in range(bootstrap):
        idx = rng.integers(0, len(points), len(points))
        if len(set(log_n[idx])) < 2 or len(set(log_d[idx])) < 2:
            failed += 1  # a resample with one size (or one budget) cannot identify the law
            continue
        counts.append(np.bincount(idx, minlength=len(points)))
    # A resample is the points with multiplicities: each refit runs on the distinct ones, weighted (a third fewer
    # points), and every resample's best grid start comes from one pass over the points (``_grid_scores``).
    starts: list[np.ndarray] = []
    for lo in range(0, len(counts), _BOOTSTRAP_CHUNK):
        block = np.stack(counts[lo : lo + _BOOTSTRAP_CHUNK], axis=1).astype(float)
        best = np.argmin(_grid_scores(log_n, log_d, log_l, block, delta), axis=0)
        starts.extend(_grid()[best])
    jobs = []
    for c, start in zip(counts, starts):
        taken = c > 0
        jobs.append(
            (_theta(law), start, log_n[taken], log_d[taken], log_l[taken], c[taken].astype(float), delta)
        )
    samples: list[list[float]] = []
    for refit in _map_refits(jobs):
        if refit is None:
            failed += 1
        else:
            samples.append(refit)
    arr = np.asarray(samples) if samples else np.full((1, 5), np.nan)
    lo, hi = np.percentile(arr, [2.5, 97.5], axis=0)
    residual = np.log(law(np.exp(log_n), np.exp(log_d))) - log_l
    return Fit(
        law=law,
        ci95={k: (float(lo[i]), float(hi[i])) for i, k in enumerate(PARAMS)},
        points=len(points),
        sizes=sorted({p.n for p in points}),
        huber=value,
        rms_log_residual=float(np.sqrt(np.mean(residual**2))),
        bootstrap=len(samples),
        bootstrap_failed=failed,
        samples=samples,
        at_bound=_at_bound(_theta(law)),
    )


def _refit(job: tuple[Any, ...]) -> list[float] | None:
    """One bootstrap refit: (E, A, B, alpha, beta), or None when no start converged."""
    theta, start, n_, d_, l_, weight, delta = job
    best = _minimise([theta, start], n_, d_, l_, delta, weight)
    if best is None:
        return None
    s = Law.from_theta(best[0])
    return [s.E, s.A, s.B, s.alpha, s.beta]


def _map_refits(jobs: Sequence[Any]) -> list[list[float] | None]:
    """The refits in order, over the machine's cores: each is a small single-threaded L-BFGS-B (BLAS threads only
    spin on its 5x5 products, so every worker runs with one), and the order keeps the numbers the serial ones."""
    workers = min(4, os.cpu_count() or 1)
    if workers < 2 or len(jobs) < 64:
        return [_refit(job) for job in jobs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    single = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    saved = {k: os.environ.get(k) for k in single}
    os.environ.update(
        single
    )  # read by the workers' numpy at import (spawned, so nothing of this process is forked)
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            return list(pool.map(_refit, jobs, chunksize=max(1, len(jobs) // (4 * workers))))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _at_bound(theta: np.ndarray) -> list[str]:
    near = np.isclose(theta, _LOWER, atol=1e-6) | np.isclose(theta, _UPPER, atol=1e-6)
    return [name for name, hit in zip(PARAMS, near) if hit]


# --------------------------------------------------------------------------------------------------- the law's reach


@dataclass(frozen=True)
class Floor:
    """How close any law of this form can come to one size's losses, however it is fitted.

    At a fixed N the law is ``c + B/D^beta`` (c = E + A/N^alpha >= 0): a curve that falls by less with every doubling
    of D (convex and decreasing in log D). The least worst-case relative error of such a curve through one size's
    measured losses bounds from below the error of every fit of the law at that size, on whatever points it was fitted:
    above the target's tolerance, no fit can meet the target there. Exact in c and B (a linear programme), to the
    precision of a grid and a bounded refinement in beta (the value found is attained by a curve, so it can only
    overstate the floor by that precision)."""

    n: float
    """Model size."""
    kind: str
    """merge or anneal."""
    max_abs_rel_error: float
    """The least, over c, B >= 0 and beta in the fit's range, of the worst |curve / measured - 1| over the budgets."""
    drops: list[float]
    """The measured loss fallen per doubling of D between consecutive budgets (repeats averaged): the law needs them
    to shrink."""


def _minimax_at(beta: float, d: np.ndarray, loss: np.ndarray) -> float:
    """The least worst relative error of ``c + B d^-beta`` (c, B >= 0) through ``loss``: a linear programme in c, B."""
    from scipy.optimize import linprog

    x = d**-beta
    rows = np.stack([1 / loss, x / loss, -np.ones_like(x)], axis=1)  # |(c + B x) / L - 1| <= t, t minimised
    try:
        res = linprog(
            [0.0, 0.0, 1.0],
            A_ub=np.concatenate([rows, -rows * [1, 1, -1]]),
            b_ub=np.concatenate([np.ones_like(x), -np.ones_like(x)]),
            bounds=[(0, None)] * 3,
            method="highs",
        )
    except ValueError:  # HiGHS refuses a badly scaled programme: no curve found, not an error of the fit
        return math.inf
    return float(res.x[2]) if res.success else math.inf


def floor(points: Sequence[Point]) -> Floor | None:
    """The law's floor at one size and kind (``points``: one N, one kind); None with fewer than 3 budgets, where
    a curve of the law's shape passes through every point."""
    from scipy.optimize import minimize_scalar

    pts = sorted(points, key=lambda p: p.d)
    d = np.array([p.d for p in pts], dtype=float)
    loss = np.array([p.loss for p in pts], dtype=float)
    if len(set(d)) < 3:
        return None
    # D in units of the smallest budget: the same curves (B absorbs the scale), and no d^-beta underflow.
    d_scaled = d / d.min()
    # A grid over the fit's range of beta (from near 0, where the curve is a line in log D), then the best cell refined.
    grid = np.concatenate([np.geomspace(1e-4, 0.05, 12), np.linspace(0.1, float(_UPPER[4]), 40)])
    values = [_minimax_at(b, d_scaled, loss) for b in grid]
    i = int(np.argmin(values))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    best = min(values[i], minimize_scalar(
        _minimax_at, bounds=(lo, hi), args=(d_scaled, loss), method="bounded", options={"xatol": 1e-5}).fun)  # fmt: skip
    budgets = np.unique(d)  # repeated measurements at one budget (a user's file may have them): their mean
    mean = np.array([loss[d == b].mean() for b in budgets])
    drops = -np.diff(mean) / np.diff(np.log2(budgets))
    return Floor(pts[0].n, pts[0].kind, float(best), [float(x) for x in drops])


def floors(points: Sequence[Point]) -> list[Floor]:
    """``floor`` of every size and kind with at least 3 budgets, by size then kind."""
    out = []
    for n in sorted({p.n for p in points}):
        for kind in KINDS:
            f = floor([p for p in points if p.n == n and p.kind == kind])
            if f is not None:
                out.append(f)
    return out


# --------------------------------------------------------------------------------------------------- a study


@dataclass(frozen=True)
class Prediction:
    """One held-out point: the measured losses and what each fit predicted for its annealed loss."""

    n: float
    """Model size of the held-out point."""
    d: float
    """Tokens of the held-out point."""
    anneal: float | None
    """Measured annealed loss (the ground truth predicted)."""
    merge: float | None
    """Measured merged loss at the same point."""
    predicted: dict[str, float]
    """Each fit's prediction, by kind."""
    interval: dict[str, tuple[float, float]]
    """Each fit's 95% bootstrap prediction interval, by kind."""
    rel_error: dict[str, float | None]
    """predicted / annealed - 1, by kind (None without an annealed loss)."""


@dataclass(frozen=True)
class StudyFit:
    """Separate fits on the merges and on the anneals; the held-out size predicted by both."""

    fits: dict[str, Fit]
    """By kind (merge, anneal)."""
    holdout_n: float | None
    """The model size left out of both fits (None: nothing held out)."""
    predictions: list[Prediction]
    """The held-out points."""
    delta: float = HUBER_DELTA
    """Huber delta of the fits."""
    backtest: list[Prediction] = field(default_factory=list)
    """Each fitted size from the fourth smallest on, predicted by laws fitted on the smaller fitted sizes only (no
    bootstrap: ``interval`` is empty): how well the law extrapolates in size on these runs, known without the held-out size."""
    floors: list[Floor] = field(default_factory=list)
    """Per size and kind, the least error any law of this form can have there (``floor``)."""

    def targets(self, tolerance: float = 0.01) -> dict[str, Any]:
        """The scaling study's targets, each with its numbers and met / missed."""
        out: dict[str, Any] = {}
        errors = [p.rel_error.get("merge") for p in self.predictions]
        errs = [abs(e) for e in errors if e is not None]
        if errs:
            worst = max(errs)
            out["heldout_within"] = {
                "tolerance": tolerance,
                "max_abs_rel_error": worst,
                "met": worst <= tolerance,
            }
        anneal_errs = [abs(e) for p in self.predictions if (e := p.rel_error.get("anneal")) is not None]
        if errs and anneal_errs:
            # The same held-out prediction from the anneals themselves: when it misses too, the law (or the sizes
            # trained) is what fails to extrapolate, not the merges standing in for the anneals.
            out["anneal_fit_within"] = {
                "max_abs_rel_error": max(anneal_errs),
                "met": max(anneal_errs) <= tolerance,
            }
            gaps = [
                abs(p.predicted["merge"] / p.predicted["anneal"] - 1)
                for p in self.predictions
                if {"merge", "anneal"} <= set(p.predicted)
            ]
            out["fits_agree_within"] = {"max_abs_rel_gap": max(gaps), "met": max(gaps) <= tolerance}
        if not all(f.bootstrap for f in self.fits.values()):
            out["no_intervals"] = sorted(kind for kind, f in self.fits.items() if not f.bootstrap)
        if set(KINDS) <= set(self.fits) and self.fits["anneal"].bootstrap:
            m, a = self.fits["merge"], self.fits["anneal"]
            out["exponents_inside_anneal_ci"] = {
                k: {"merge": getattr(m.law, k), "anneal_ci95": a.ci95[k],
                    "met": a.ci95[k][0] <= getattr(m.law, k) <= a.ci95[k][1]}
                for k in ("alpha", "beta")
            }  # fmt: skip
        bound = {kind: f.at_bound for kind, f in self.fits.items() if f.at_bound}
        if bound:
            out["at_bound"] = bound
        backtest = [(abs(e), p) for p in self.backtest if (e := p.rel_error.get("merge")) is not None]
        if backtest:
            worst, at = max(backtest, key=lambda x: x[0])
            out["backtest_within"] = {
                "max_abs_rel_error": worst,
                "n": at.n,
                "d": at.d,
                "sizes": sorted({p.n for _, p in backtest}),
                "met": worst <= tolerance,
            }
        held = next((f for f in self.floors if f.n == self.holdout_n and f.kind == "anneal"), None)
        if held is not None:
            out["heldout_floor"] = {
                "n": held.n,
                "max_abs_rel_error": held.max_abs_rel_error,
                "drops": held.drops,
                "reachable": held.max_abs_rel_error <= tolerance,
            }
        return out


def fit_study(
    points: Sequence[Point], *, holdout: str = "largest", bootstrap: int = 400, seed: int = 0
) -> StudyFit:
    """Fit each kind present on every point but the held-out size, and predict the held-out annealed losses.

    Args:
        holdout: ``largest`` (leave the largest N out of both fits and predict it) or ``none``.
    """
    if holdout not in ("largest", "none"):
        raise PmakitError(f"holdout must be largest or none, got {holdout!r}")
    held = max(p.n for p in points) if holdout == "largest" and points else None
    fits = {}
    for kind in KINDS:
        mine = [p for p in points if p.kind == kind and p.n != held]
        if mine:
            try:
                fits[kind] = fit(mine, bootstrap=bootstrap, seed=seed)
            except PmakitError as e:
                raise PmakitError(f"{kind} points: {e}") from None
    if not fits:
        others = (
            f" besides the held-out size N = {held:,.0f} (--holdout none fits every size)" if held else ""
        )
        raise PmakitError(f"no {' or '.join(KINDS)} points to fit{others}")
    fitted = [p for p in points if p.n != held]
    return StudyFit(
        fits,
        held,
        _predictions(points, held, {k: f.law for k, f in fits.items()}, fits),
        backtest=backtest(fitted),
        floors=floors(points),
    )


def backtest(points: Sequence[Point]) -> list[Prediction]:
    """Each size of ``points`` from the fourth smallest on, predicted from the smaller sizes alone: per kind, the law
    fitted on the points below that size (the same fit, without bootstrap) against that size's annealed loss.

    What the held-out prediction does, rehearsed on sizes the study already fits: a law that misses here has no
    claim on the held-out size, and that is known without looking at it. It starts at the fourth size: from two sizes,
    E, A and alpha are not identified and the extrapolation in N is arbitrary. A size whose smaller sizes give too
    few points for a fit is left out."""
    sizes = sorted({p.n for p in points})
    out = []
    for n in sizes[3:]:
        laws = {}
        for kind in KINDS:
            below = [p for p in points if p.kind == kind and p.n < n]
            try:
                laws[kind] = fit_law(below)[0]
            except PmakitError:
                continue
        if laws:
            out += _predictions(points, n, laws)
    return out


def _predictions(
    points: Sequence[Point],
    held: float | None,
    laws: Mapping[str, Law],
    fits: Mapping[str, Fit] | None = None,
) -> list[Prediction]:
    """The annealed loss at size ``held``, per budget, as each law predicts it (with ``fits``: their intervals)."""
    if held is None:
        return []
    at = {(p.kind, p.d): p.loss for p in points if p.n == held}
    out = []
    for d in sorted({d for (_, d) in at}):
        anneal = at.get(("anneal", d))
        predicted = {k: float(law(held, d)) for k, law in laws.items()}
        out.append(
            Prediction(
                n=held,
                d=d,
                anneal=anneal,
                merge=at.get(("merge", d)),
                predicted=predicted,
                interval={k: f.predict_interval(held, d) for k, f in (fits or {}).items()},
                rel_error={k: None if anneal is None else v / anneal - 1 for k, v in predicted.items()},
            )
        )
    return out


def to_json(study: StudyFit) -> dict[str, Any]:
    """A JSON-ready record of the fits (bootstrap samples left out), the predictions and the targets."""
    fits = {}
    for kind, f in study.fits.items():
        d = asdict(f)
        d.pop("samples")
        d["law"] = asdict(f.law)
        fits[kind] = d
    return _null_nans(
        {
            "law": "L(N, D) = E + A / N^alpha + B / D^beta",
            "loss": f"Huber (delta {study.delta:g}) on log L; scipy L-BFGS-B from a grid of initial values",
            "holdout_n": study.holdout_n,
            "fits": fits,
            "predictions": [asdict(p) for p in study.predictions],
            "backtest": [asdict(p) for p in study.backtest],
            "floors": [asdict(f) for f in study.floors],
            "targets": study.targets(),
        }
    )


def _null_nans(x: Any) -> Any:
    """NaN (an interval without bootstrap refits) as null: scaling_fit.json stays strict JSON."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _null_nans(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_null_nans(v) for v in x]
    return x


# --------------------------------------------------------------------------------------------------- files

_VALUE_RANGE = (1e-30, 1e30)
_ALIASES = {
    "n": ("params", "n", "parameters", "non_embedding_params"),
    "d": ("tokens", "d"),
    "loss": ("loss", "val_loss"),
    "kind": ("kind",),
}


def _pick(record: Mapping[str, Any], field_name: str, where: str) -> Any:
    for name in _ALIASES[field_name]:
        for key in (name, name.upper()):
            if key in record and record[key] not in (None, ""):
                return record[key]
    raise PmakitError(f"{where}: no {' / '.join(_ALIASES[field_name])} column")


def _point(record: Mapping[str, Any], where: str) -> Point | None:
    kind = str(_pick(record, "kind", where)).strip().lower()
    if kind not in KINDS:
        return None  # other rows (latest snapshots, candidates) are not fitted
    values = []
    for name in ("n", "d", "loss"):
        raw = _pick(record, name, where)
        try:
            x = float(raw)
        except (TypeError, ValueError):
            raise PmakitError(f"{where}: {name} value {raw!r} is not a number") from None
        if not (math.isfinite(x) and x > 0):
            raise PmakitError(f"{where}: {name} must be a positive number, got {raw!r}")
        if not _VALUE_RANGE[0] <= x <= _VALUE_RANGE[1]:
            # Far outside any model size, token count or loss in nats; their reciprocals overflow the floor's LP.
            raise PmakitError(
                f"{where}: {name} {raw!r} is outside {_VALUE_RANGE[0]:g} .. {_VALUE_RANGE[1]:g}"
            )
        values.append(x)
    return Point(values[0], values[1], values[2], kind)


def _records(path: Path) -> list[tuple[str, Mapping[str, Any]]]:
    if not path.is_file():
        raise PmakitError(f"{path}: no such results file")
    text = read_regular(path, RESULTS_BYTES).decode("utf-8", errors="replace")
    if path.suffix in (".jsonl", ".json"):
        out: list[tuple[str, Mapping[str, Any]]] = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            obj = loads_json(line, f"{path}:{i}")
            if not isinstance(obj, dict):
                raise PmakitError(f"{path}:{i}: not a JSON object")
            out.append((f"{path}:{i}", obj))
        return out
    try:
        rows = list(csv.DictReader(text.splitlines()))
    except csv.Error as e:  # a field over csv's own limit (128 KiB), a NUL byte
        raise PmakitError(f"{path}: not a readable CSV file ({e})") from None
    return [(f"{path}:{i + 2}", r) for i, r in enumerate(rows)]


def read_points(paths: Sequence[str | Path]) -> list[Point]:
    """The merge and anneal points of results files (CSV or JSONL; columns params|N, tokens|D, loss|val_loss,
    kind). Rows of another kind are skipped; a file without a usable point is an error naming it."""
    points: list[Point] = []
    for path in map(Path, paths):
        mine = [p for where, r in _records(path) if (p := _point(r, where)) is not None]
        if not mine:
            raise PmakitError(f"{path}: no rows with kind merge or anneal")
        points += mine
        if len(points) > SCALING_POINTS.value:
            raise refuse(SCALING_POINTS, f"{path}: {len(points):,} merge and anneal points")
    return points
