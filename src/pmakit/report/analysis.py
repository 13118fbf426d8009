"""The numbers the report shows, derived from the results rows: pure functions, no formatting, no I/O.

Sign convention: a *gain* is ``latest - model`` (positive = the model beats the latest snapshot), i.e. minus the
``delta_vs_latest`` column, with the column's paired standard error.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pmakit.report.load import Row, RunData
from pmakit.weights import WEIGHTINGS, uses_alpha

NOISE_Z = 2.0
"""A gain within this many standard errors of zero is called noise in the report's sentences."""


@dataclass(frozen=True)
class Gain:
    """How much lower a model's loss is than the latest snapshot's, with the paired standard error."""

    value: float
    """latest - model, nats/token (positive = better than latest)."""
    se: float | None
    """Paired standard error over the same validation batches (None when not recorded)."""

    @property
    def z(self) -> float | None:
        """The gain in standard errors."""
        return self.value / self.se if self.se else None


@dataclass(frozen=True)
class Ratio:
    """A quantity derived from paired comparisons (a difference of two models, a share of a gain), with its s.e.

    When results.jsonl carries per-batch losses, the s.e. is computed on the same batches (``exact``). Otherwise
    results.csv only has each model's paired s.e. against the latest snapshot, and the s.e. of e.g.
    merged - annealed is only known to lie in [|s1 - s2|, s1 + s2] (any correlation).
    """

    value: float
    """The quantity itself."""
    se_bound: float | None
    """Its s.e. (exact) or an upper bound of it."""
    se_floor: float | None = None
    """A lower bound of its s.e. (equal to se_bound when exact; None when unknown)."""

    @property
    def exact(self) -> bool:
        """The s.e. was computed from per-batch losses, not bounded."""
        return self.se_bound is not None and self.se_floor == self.se_bound


def _mean_se(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error over batches, as pmakit.evaluate computes them (n - 1 in the variance)."""
    n = len(xs)
    mean = math.fsum(xs) / n
    var = math.fsum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, math.sqrt(var / n)


def _same_batches(*rows: Row | None) -> list[tuple[float, ...]] | None:
    """The rows' per-batch losses when every row has them, on the same number of batches."""
    losses = [r.batch_losses if r is not None else None for r in rows]
    if any(x is None for x in losses) or len({len(x) for x in losses if x is not None}) != 1:
        return None
    return [x for x in losses if x is not None]


def difference(a: Gain, b: Gain) -> Ratio:
    """a - b of two gains over the same latest snapshot, with the s.e. bounds |s_a - s_b| <= se <= s_a + s_b."""
    if a.se is None or b.se is None:
        return Ratio(a.value - b.value, None)
    return Ratio(a.value - b.value, a.se + b.se, abs(a.se - b.se))


def compare(a: Row | None, b: Row | None, latest: Row | None) -> Ratio | None:
    """val_loss(a) - val_loss(b): paired over batches when both rows carry batch losses, else from their gains
    over ``latest`` with bounds on the s.e."""
    batches = _same_batches(a, b)
    if batches is not None:
        mean, se = _mean_se([x - y for x, y in zip(*batches)])
        return Ratio(mean, se, se)
    ga, gb = gain_over_latest(a, latest), gain_over_latest(b, latest)
    return None if ga is None or gb is None else difference(gb, ga)


def judge(d: Ratio, if_positive: str, if_negative: str) -> str:
    """A clause judging a difference: 'X is better by 3.7 paired standard errors', 'within noise (...)'; when
    the s.e. is only bounded: 'by at least ...', 'at most ...', or undecided between the two bounds."""
    if not d.se_bound:
        return "no standard error available to judge it"
    who = if_positive if d.value > 0 else if_negative
    z_low = abs(d.value) / d.se_bound
    if d.exact:
        if z_low >= NOISE_Z:
            return f"{who} by {z_low:.1f} paired standard errors"
        return f"within noise ({z_low:.1f} paired standard errors)"
    z_high = abs(d.value) / d.se_floor if d.se_floor else None
    if z_low >= NOISE_Z:
        return f"{who} by at least {z_low:.1f} standard errors"
    if z_high is not None and z_high < NOISE_Z:
        return f"within noise: at most {z_high:.1f} standard errors"
    upper = f"{z_high:.1f}" if z_high is not None else "any number of"
    return (
        f"between {z_low:.1f} and {upper} standard errors depending on a correlation the results do not record, "
        "so this run cannot tell"
    )


@dataclass(frozen=True)
class ForkSummary:
    """Latest vs merges vs anneal at one fork point, all evaluated at the same tokens."""

    fork_tokens: int
    """The fork point F."""
    eval_tokens: int | None
    """F + D: where latest, merges and the anneal are compared."""
    anneal_tokens: int | None
    """D, the anneal length (from experiment.json, else eval_tokens - F)."""
    latest: Row | None
    """The constant-LR run's snapshot at eval_tokens."""
    merges: list[Row]
    """Every merge evaluated at eval_tokens."""
    annealed: Row | None
    """The anneal branch after D tokens."""
    test: ForkSummary | None = None
    """The same fork's headline rows on the test split (None for a run without them); its best merges are the
    ones chosen on the selection split, never the minimum over the test split."""

    @property
    def best_merge(self) -> Row | None:
        """The merge chosen on the selection split (the row with role 'best'), else the lowest val_loss here."""
        return self.role("best") or min((r for r in self.merges if not r.role), key=_loss, default=None)

    @property
    def best_sma(self) -> Row | None:
        """The SMA chosen on the selection split (role 'best-sma'), else the SMA merge with the lowest val_loss."""
        best = self.role("best")
        if self.role("best-sma") or (best is not None and best.method == "sma"):
            return self.role("best-sma") or best  # the experiment scores one row when the two choices agree
        return min((r for r in self.merges if r.method == "sma" and not r.role), key=_loss, default=None)

    @property
    def oracle(self) -> Row | None:
        """The lowest of the SMA cells scored on this split for scale (role 'oracle': ``experiment.oracle``), a
        minimum taken after the fact, never a choice."""
        return min((r for r in self.merges if r.role == "oracle"), key=_loss, default=None)

    def role(self, role: str) -> Row | None:
        """The merge of a headline role ('best', 'best-sma', 'fixed', 'tuned'), if evaluated."""
        return next((r for r in self.merges if r.role == role), None)

    @property
    def headline(self) -> ForkSummary:
        """What the headline reports: the test-split rows when the run has them, else these rows."""
        return self.test or self

    def gain(self, row: Row | None) -> Gain | None:
        """``row``'s gain over the latest snapshot of this fork."""
        return gain_over_latest(row, self.latest)

    def recovered(self, row: Row | None) -> Ratio | None:
        """Fraction of the anneal's gain that ``row`` recovers: (latest - row) / (latest - annealed). None where
        the anneal's own gain is within noise (under ``NOISE_Z`` paired s.e.): a ratio over a denominator that may
        be zero says nothing (the demo's early fork gave 671% ± 358%)."""
        if self.anneal_within_noise:
            return None
        batches = _same_batches(self.latest, row, self.annealed)
        if batches is not None:
            return recovered_from_batches(*batches)
        return recovered_fraction(self.gain(row), self.gain(self.annealed))

    @property
    def anneal_within_noise(self) -> bool:
        """The anneal's gain over the latest snapshot is known and under ``NOISE_Z`` of its paired s.e. either way
        (an anneal clearly worse than the latest snapshot is not noise: the share is then undefined, and said so)."""
        g = self.gain(self.annealed)
        return g is not None and g.z is not None and abs(g.z) < NOISE_Z

    def gap_to_anneal(self, row: Row | None) -> Ratio | None:
        """row - annealed val_loss (positive = the anneal is better)."""
        return compare(row, self.annealed, self.latest)


def _loss(row: Row) -> float:
    return row.val_loss if row.val_loss is not None else float("inf")


def gain_over_latest(row: Row | None, latest: Row | None) -> Gain | None:
    """Prefer the file's paired delta; fall back to the difference of the two losses (then no s.e.)."""
    if row is None:
        return None
    if row.delta_vs_latest is not None:
        return Gain(-row.delta_vs_latest, row.delta_se)
    if latest is not None and latest.val_loss is not None and row.val_loss is not None:
        return Gain(latest.val_loss - row.val_loss, None)
    return None


def recovered_fraction(merge: Gain | None, anneal: Gain | None) -> Ratio | None:
    """merge gain / anneal gain; undefined unless the anneal beats the latest snapshot.

    The s.e. bound is first order (delta method) with |cov| <= s_m * s_a:
    se(r) <= (s_m + |r| s_a) / g_a.
    """
    if merge is None or anneal is None or anneal.value <= 0:
        return None
    r = merge.value / anneal.value
    bound = None
    if merge.se is not None and anneal.se is not None:
        bound = (merge.se + abs(r) * anneal.se) / anneal.value
    return Ratio(r, bound)


def recovered_from_batches(
    latest: Sequence[float], merged: Sequence[float], annealed: Sequence[float]
) -> Ratio | None:
    """(latest - merged) / (latest - annealed) with its first-order (delta-method) s.e. over the same batches:
    var(r) = (var(g_m) + r^2 var(g_a) - 2 r cov(g_m, g_a)) / g_a^2, all variances of batch means."""
    n = len(latest)
    gm = [x - y for x, y in zip(latest, merged)]
    ga = [x - y for x, y in zip(latest, annealed)]
    mean_m, mean_a = math.fsum(gm) / n, math.fsum(ga) / n
    if mean_a <= 0:
        return None
    r = mean_m / mean_a

    def cov(xs: list[float], mx: float, ys: list[float], my: float) -> float:
        return math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys)) / (n - 1) / n

    var = (
        cov(gm, mean_m, gm, mean_m)
        + r * r * cov(ga, mean_a, ga, mean_a)
        - 2 * r * cov(gm, mean_m, ga, mean_a)
    )
    se = math.sqrt(max(var, 0.0)) / mean_a
    return Ratio(r, se, se)


def gap(merge: Gain | None, anneal: Gain | None) -> Ratio | None:
    """merged - annealed loss = anneal gain - merge gain (positive: the anneal is better)."""
    if merge is None or anneal is None:
        return None
    return difference(anneal, merge)


def verdict(z: float | None, subject: str, reference: str = "the latest snapshot") -> str:
    """A clause judging a gain from its z-score, e.g. 'X beats Y by 12.3 paired standard errors'."""
    if z is None:
        return f"{subject} has no paired standard error recorded, so its margin over {reference} cannot be judged"
    if z >= NOISE_Z:
        return f"{subject} beats {reference} by {z:.1f} paired standard errors"
    if z <= -NOISE_Z:
        return f"{subject} is worse than {reference} by {-z:.1f} paired standard errors"
    return f"{subject} is within noise of {reference} ({z:+.1f} paired standard errors)"


# --- forks -----------------------------------------------------------------------------------------------


def experiment_forks(experiment: dict[str, Any]) -> dict[int, dict[str, int | None]]:
    """experiment.json's fork list by fork point: {F: {"anneal_tokens": D, "eval_tokens": F + D}}."""
    forks: dict[int, dict[str, int | None]] = {}
    raw = experiment.get("forks")
    for f in raw if isinstance(raw, list) else []:
        if not isinstance(f, dict) or not isinstance(f.get("fork_tokens"), int | float):
            continue
        forks[int(f["fork_tokens"])] = {
            k: int(f[k]) if isinstance(f.get(k), int | float) else None
            for k in ("anneal_tokens", "eval_tokens")
        }
    return forks


def fork_points(data: RunData) -> list[int]:
    """Fork points that have at least one result row, in order."""
    return sorted({r.fork_tokens for r in data.rows if r.fork_tokens is not None})


def summarize_fork(data: RunData, fork: int, split: str | None = None) -> ForkSummary:
    """Collect the rows compared at ``fork``: all at the fork's evaluation tokens F + D. The grid rows (selection
    split, or the whole held-out set of an older run) make the summary; the test rows its ``test`` part."""
    if split is None:
        test = summarize_fork(data, fork, "test")
        grid = summarize_fork(data, fork, "grid")
        return grid if not (test.latest or test.merges) else replace(grid, test=test)
    rows = [r for r in data.rows if r.fork_tokens == fork and (r.split == "test") == (split == "test")]
    info = experiment_forks(data.experiment).get(fork, {})
    eval_tokens = info.get("eval_tokens")
    if eval_tokens is None:
        latest_tokens = [r.tokens for r in rows if r.model == "latest" and r.tokens is not None]
        eval_tokens = max(latest_tokens or [r.tokens for r in rows if r.tokens is not None] or [0]) or None
    at_eval = [r for r in rows if eval_tokens is None or r.tokens is None or r.tokens == eval_tokens]
    anneal_tokens = info.get("anneal_tokens")
    if anneal_tokens is None and eval_tokens is not None and eval_tokens > fork:
        anneal_tokens = eval_tokens - fork
    return ForkSummary(
        fork_tokens=fork,
        eval_tokens=eval_tokens,
        anneal_tokens=anneal_tokens,
        latest=next((r for r in at_eval if r.model == "latest"), None),
        merges=[r for r in at_eval if r.model == "merged"],
        annealed=next((r for r in at_eval if r.model == "annealed"), None),
    )


def summarize_forks(data: RunData) -> list[ForkSummary]:
    """One summary per fork point with results, earliest first."""
    return [summarize_fork(data, f) for f in fork_points(data)]


@dataclass(frozen=True)
class StablePoint:
    """Latest vs merges at one point of the stable phase (paper E1), outside any fork."""

    tokens: int
    """Training tokens of the evaluation."""
    latest: Row | None
    """The latest snapshot there."""
    merges: list[Row]
    """Merges ending there."""

    @property
    def best_merge(self) -> Row | None:
        """The merge with the lowest val_loss."""
        return min(self.merges, key=_loss, default=None)


def stable_points(data: RunData) -> list[StablePoint]:
    """Rows without a fork point, grouped by tokens."""
    by_tokens: dict[int, list[Row]] = {}
    for r in data.rows:
        if r.fork_tokens is None and r.tokens is not None:
            by_tokens.setdefault(r.tokens, []).append(r)
    return [
        StablePoint(
            t,
            next((r for r in rows if r.model == "latest"), None),
            [r for r in rows if r.model == "merged"],
        )
        for t, rows in sorted(by_tokens.items())
    ]


# --- grids: weightings, N, V ----------------------------------------------------------------------------


def split_note(rows: Iterable[Row | None]) -> str:
    """Which held-out split and how many batches the rows were scored on, for a figure's title: 'test split,
    23 batches'. A figure states it so that its numbers can be matched with the table of the same split."""
    scored = [r for r in rows if r is not None]
    splits = {r.split for r in scored}
    name = (
        f"{splits.pop()} split"
        if len(splits) == 1 and "" not in splits
        else "whole held-out set"
        if splits == {""}
        else "mixed splits"
    )
    counts = {len(r.batch_losses) for r in scored if r.batch_losses}
    return f"{name}, {counts.pop()} batches" if len(counts) == 1 else name


def weighting_key(row: Row) -> str:
    """'sma', 'wma', 'ema@0.1', 'wsm-1sqrt', ...: EMA weightings differ by alpha."""
    if uses_alpha(row.method) and row.alpha is not None:
        return f"{row.method}@{row.alpha:g}"
    return row.method


def weighting_label(key: str) -> str:
    """'ema@0.1' -> 'EMA α=0.1', 'wsm-1sqrt' -> 'WSM 1-sqrt'."""
    method, _, alpha = key.partition("@")
    known = WEIGHTINGS.get(method)
    name = known.label if known is not None else method.upper() or "?"
    return f"{name} α={alpha}" if alpha else name


def weighting_sort_key(key: str) -> tuple[int, str]:
    """Weightings in the registry's order (unknown ones last), EMA factors in order within one."""
    method, _, alpha = key.partition("@")
    order = list(WEIGHTINGS)
    return (order.index(method) if method in order else len(order)), alpha


def base_interval(data: RunData) -> int | None:
    """V0, the snapshot interval: experiment.json's base_every_tokens, else the smallest V in the results."""
    v0 = data.experiment.get("base_every_tokens")
    if isinstance(v0, int | float) and v0 > 0:
        return int(v0)
    vs = [r.v_tokens for r in data.rows if r.v_tokens]
    return min(vs) if vs else None


def most_covered(
    candidates: Iterable[tuple[int | None, Any]], prefer: Callable[[int], float] = lambda x: 0.0
) -> int | None:
    """The value seen with the most distinct items among (value, item) pairs; ties go to the highest
    ``prefer(value)``. None values are ignored."""
    counts = Counter(v for v, _ in set(candidates) if v is not None)
    if not counts:
        return None
    return max(counts, key=lambda v: (counts[v], prefer(v)))


def grid_rows(forks: Sequence[ForkSummary], method: str) -> list[tuple[ForkSummary, Row]]:
    """(fork, merge) pairs of one weighting with N and V known."""
    return [(f, r) for f in forks for r in f.merges if r.method == method and r.n and r.v_tokens]


def v_for_n_sweep(forks: Sequence[ForkSummary], method: str = "sma") -> int | None:
    """The V evaluated at the most (fork, N) pairs; ties go to the smallest V."""
    return most_covered(
        ((r.v_tokens, (f.fork_tokens, r.n)) for f, r in grid_rows(forks, method)), lambda v: -v
    )


def n_for_v_sweep(forks: Sequence[ForkSummary], method: str = "sma") -> int | None:
    """The N evaluated at the most (fork, V) pairs; ties go to the largest N (where staleness shows most)."""
    return most_covered(((r.n, (f.fork_tokens, r.v_tokens)) for f, r in grid_rows(forks, method)), float)


def v_for_weightings(forks: Sequence[ForkSummary]) -> int | None:
    """The V with the most (fork, N, weighting) merges; ties go to the smallest V."""
    pairs = [
        (r.v_tokens, (f.fork_tokens, r.n, weighting_key(r)))
        for f in forks
        for r in f.merges
        if r.n and r.v_tokens and r.method
    ]
    return most_covered(pairs, lambda v: -v)


def sweep(
    fork: ForkSummary, *, method: str, n: int | None = None, v: int | None = None
) -> list[tuple[int, Gain]]:
    """Gains of one weighting along N (with ``v`` fixed) or along V (with ``n`` fixed), sorted by x."""
    points = []
    for r in fork.merges:
        if r.method != method or not r.n or not r.v_tokens:
            continue
        if (v is not None and r.v_tokens == v) or (n is not None and r.n == n):
            g = fork.gain(r)
            if g is not None:
                points.append((r.v_tokens if n is not None else r.n, g))
    return sorted(points, key=lambda p: p[0])


def weighting_rows(fork: ForkSummary, v: int | None) -> list[Row]:
    """Merges at interval ``v`` for the N values where at least two weightings were evaluated (a lone SMA bar
    compares nothing)."""
    rows = [r for r in fork.merges if r.method and r.n and r.v_tokens == v and fork.gain(r) is not None]
    keys_per_n: dict[int | None, set[str]] = {}
    for r in rows:
        keys_per_n.setdefault(r.n, set()).add(weighting_key(r))
    return [r for r in rows if len(keys_per_n[r.n]) >= 2]
