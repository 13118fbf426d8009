"""Choose which snapshots to merge, by tokens. Pure: snapshots in (oldest first), snapshots out (oldest first)."""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Iterable, Sequence

from pmakit.errors import PmakitError
from pmakit.snapshot import Snapshot, gather
from pmakit.units import format_tokens

log = logging.getLogger(__name__)


DEFAULT_LAST = 10
"""The paper's default N, for runs that recorded none."""

DEFAULT_WINDOW_RULE = (
    f"the last {DEFAULT_LAST}, or the window its own online merge used (pmakit train records it) with an info: "
    "line; all of them, with an info: line, when fewer exist"
)
"""The default window of a merge of a run directory, as ``--help`` states it (``default_last`` applies it)."""


def default_last(snapshots: Sequence[Snapshot]) -> int:
    """N of ``pmakit merge RUN`` without ``--last``: the window the run's own online merge used (``window`` in the
    newest snapshot's metadata, written by ``pmakit train`` and the callbacks), else 10; a run with fewer snapshots
    merges all it has, with a note."""
    recorded = snapshots[-1].meta.get("window") if snapshots else None
    from_run = isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0
    n = recorded if from_run and isinstance(recorded, int) else DEFAULT_LAST
    why = "the window of the run's own online merge" if from_run else "the default window"
    if len(snapshots) < n:
        log.info("merging all %d snapshots (%s is %d; pass --last to choose)", len(snapshots), why, n)
        return max(len(snapshots), 1)
    if from_run and n != DEFAULT_LAST:
        log.info("merging the last %d snapshots: %s (pass --last to choose)", n, why)
    return n


def select_for_merge(
    paths: Iterable[str | os.PathLike[str]],
    *,
    last: int | None = None,
    every: int | None = None,
    until: int | None = None,
    tokens_per_step: int | None = None,
    exclude: Iterable[str | os.PathLike[str]] = (),
) -> list[Snapshot]:
    """The snapshots ``pmakit merge PATHS`` merges, oldest first.

    Each path is a snapshot or a run directory. Snapshots named one by one are all used; with a run directory
    and neither ``last`` nor ``every``, the window is the default one (``DEFAULT_WINDOW_RULE``, ``default_last``).
    The other arguments are ``select_snapshots``'s and ``gather``'s.
    """
    snapshots, from_run = gather(paths, tokens_per_step, exclude)
    return select_window(snapshots, from_run, last=last, every=every, until=until)


def select_window(
    snapshots: Sequence[Snapshot],
    from_run: bool,
    *,
    last: int | None = None,
    every: int | None = None,
    until: int | None = None,
) -> list[Snapshot]:
    """``select_snapshots`` with the default window (``default_last``) where ``last`` and ``every`` are None and
    the snapshots came from a run directory (``from_run``); snapshots named one by one are all used."""
    if last is None and from_run and every is None:
        last = default_last([s for s in snapshots if until is None or s.tokens <= until])
    return select_snapshots(snapshots, last=last, every=every, until=until)


def select_snapshots(
    snapshots: Sequence[Snapshot],
    *,
    last: int | None = 10,
    every: int | None = None,
    until: int | None = None,
) -> list[Snapshot]:
    """The window of snapshots to merge, oldest first.

    Args:
        snapshots: candidates, oldest first (as ``discover`` returns them).
        last: how many to take (N); None takes every snapshot up to the window's end.
        every: spacing V in tokens between chosen snapshots, going back from the window's end. A snapshot counts as
            being at a target when it is the nearest one to it and closer than half the run's save interval (savers
            that save at the first step past a multiple of V land a little late).
        until: the window ends at the newest snapshot with tokens <= until (default: the newest).

    Example: snapshots every 100 tokens up to 1000, last=4, every=200 -> [400, 600, 800, 1000].
    """
    if not snapshots:
        raise PmakitError("no complete snapshots to merge")
    if last is not None and last < 1:
        raise PmakitError(f"--last must be at least 1, got {last}")
    if every is not None and every <= 0:
        raise PmakitError(f"--every must be positive, got {every}")
    pool = [s for s in snapshots if until is None or s.tokens <= until]
    if not pool:
        raise PmakitError(
            f"no snapshot at or before {format_tokens(until or 0)} tokens "
            f"(the oldest is at {format_tokens(snapshots[0].tokens)})"
        )
    end = pool[-1]
    if every is None:
        chosen = pool if last is None else pool[-last:]
        if last is not None and len(chosen) < last:
            raise PmakitError(
                f"--last {last} asks for {last} snapshots but only {len(pool)} exist up to "
                f"{format_tokens(end.tokens)} tokens"
            )
        return list(chosen)
    return _every(pool, end, last, every)


def _every(pool: list[Snapshot], end: Snapshot, last: int | None, every: int) -> list[Snapshot]:
    gaps = [b.tokens - a.tokens for a, b in zip(pool, pool[1:])]
    base = statistics.median(gaps) if gaps else every
    tolerance = min(base, every) / 2
    count = last if last is not None else end.tokens // every + 1
    chosen: list[Snapshot] = []
    for k in range(count):
        target = end.tokens - k * every
        if target < pool[0].tokens - tolerance:
            if last is None:
                break
            raise PmakitError(
                f"--last {last} --every {format_tokens(every)} spans {format_tokens((last - 1) * every)} tokens back "
                f"from {format_tokens(end.tokens)}, past the oldest snapshot ({format_tokens(pool[0].tokens)}); "
                f"{len(chosen)} fit"
            )
        nearest = min(pool, key=lambda s: abs(s.tokens - target))
        if abs(nearest.tokens - target) >= tolerance or nearest in chosen:
            raise PmakitError(
                f"no snapshot at {format_tokens(target)} tokens for --every {format_tokens(every)} "
                f"(nearest: {format_tokens(nearest.tokens)}); snapshots are about "
                f"{format_tokens(base)} apart"
            )
        chosen.append(nearest)
    return chosen[::-1]
