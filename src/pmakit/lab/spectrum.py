"""The paper's low-pass reading made measurable: the power spectrum of the snapshot trajectory, and what each merge
window lets through.

Along the stable phase the weights drift slowly and jitter fast. Projected on K fixed random unit directions
(seeded; the same for every snapshot), the snapshots give K time series sampled every V tokens; their periodograms
(scipy.signal, mean removed), averaged over directions, are the trajectory's power spectrum in cycles per snapshot
interval (0 to 0.5). A merge with weights w_0..w_{N-1} (oldest first) is a linear filter of that series with
gain |H(f)|^2 = |sum_k w_k exp(-2 pi i f k)|^2: SMA is a sinc-like low-pass with its first zero at f = 1/N, EMA a
one-pole low-pass, the WSM shapes smoother windows. The share of the trajectory's power above the drift that a
filter removes says how much jitter one merge averages out.

Writes RUN/spectrum.json; the report draws plots/spectrum.png from it (``pmakit.report.spectrum``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pmakit.errors import PmakitError
from pmakit.runs import MAIN_RUN, atomic_write_json, snapshots_dir
from pmakit.snapshot import Snapshot
from pmakit.weights import get_weights

log = logging.getLogger(__name__)

DIRECTIONS = 16
"""Random directions the deviations are projected on."""
KEEP_BYTES = 256 << 20
"""The most memory the directions are kept in across snapshots (drawn again per snapshot beyond it)."""


def trajectory(
    snapshots: Sequence[Snapshot],
    *,
    directions: int = DIRECTIONS,
    seed: int = 0,
    keep_bytes: int = KEEP_BYTES,
) -> np.ndarray:
    """(T, K) projections of each snapshot's float weights on K seeded random unit directions.

    One snapshot is read at a time. The directions are drawn tensor by tensor in a fixed key order from the same
    seed for every snapshot, so they are the same for all of them: drawn once and kept where K x (the float
    parameters) fits in ``keep_bytes`` (the demo's model: 68 MB; its 59 snapshots' trajectory in 0.5 s instead of
    3.0 s), drawn again per snapshot otherwise, so that memory stays K x (largest tensor) beyond one state. Both give
    the same numbers.
    """
    from pmakit.formats import is_float, read_state

    out = np.zeros((len(snapshots), directions))
    kept: list[torch.Tensor] = []  # the directions, in ``kept_for``'s order
    kept_for: list[tuple[str, int]] | None = None
    for t, snap in enumerate(snapshots):
        state = read_state(snap.path)
        sizes = [(n, state[n].numel()) for n in sorted(state) if is_float(state[n].dtype)]
        total = sum(size for _, size in sizes)
        reuse = sizes == kept_for
        keep = kept_for is None and directions * 4 * total <= keep_bytes
        g = torch.Generator().manual_seed(seed)
        for i, (name, size) in enumerate(sizes):
            if reuse:
                direction = kept[i]
            else:
                direction = torch.randn((directions, size), generator=g)
                if keep:
                    kept.append(direction)
            out[t] += (direction @ state[name].detach().reshape(-1).float()).double().numpy()
        if keep:
            kept_for = sizes
        out[t] /= np.sqrt(max(total, 1))  # unit directions: E|d|^2 = total
    return out


def power_spectrum(series: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Frequencies (cycles per snapshot) and the periodogram averaged over the columns of ``series`` (T, K)."""
    from scipy.signal import periodogram

    if series.shape[0] < 4:
        raise PmakitError(f"a spectrum needs at least 4 snapshots, got {series.shape[0]}")
    f, p = periodogram(series, axis=0, detrend="constant", scaling="spectrum")
    return f, p.mean(axis=1)


def gain(weights: Sequence[float], freqs: np.ndarray) -> np.ndarray:
    """|H(f)|^2 of a merge with ``weights`` (oldest first) as a filter of the snapshot series."""
    w = np.asarray(weights, dtype=float)[::-1]  # k = 0 is the newest snapshot
    k = np.arange(len(w))
    response = (w[None, :] * np.exp(-2j * np.pi * freqs[:, None] * k[None, :])).sum(axis=1)
    return np.abs(response) ** 2


def filters(n: int, alpha: float = 0.2) -> dict[str, list[float]]:
    """The windows drawn on the spectrum: SMA, EMA and WSM 1-sqrt over N snapshots."""
    return {
        f"SMA N={n}": get_weights("sma", n),
        f"EMA α={alpha:g} N={n}": get_weights("ema", n, alpha=alpha),
        f"WSM 1-sqrt N={n}": get_weights("wsm-1sqrt", n),
    }


def spectrum(snapshots: Sequence[Snapshot], n: int, *, seed: int = 0) -> dict[str, Any]:
    """The record spectrum.json holds: frequencies, power, each filter's gain and the power share it removes."""
    freqs, power = power_spectrum(trajectory(snapshots, seed=seed))
    above = freqs > 0  # the mean (f = 0) is what a merge keeps by construction
    total = float(power[above].sum())
    record: dict[str, Any] = {
        "frequencies": freqs.tolist(),
        "power": power.tolist(),
        "snapshots": [s.tokens for s in snapshots],
        "directions": DIRECTIONS,
        "filters": {},
    }
    for label, weights in filters(n).items():
        g = gain(weights, freqs)
        removed = float((power[above] * (1 - g[above])).sum() / total) if total > 0 else None
        record["filters"][label] = {"weights": weights, "gain": g.tolist(), "removed_power": removed}
    return record


def window_from_spectrum(freqs: np.ndarray, power: np.ndarray, max_n: int) -> dict[str, float | int]:
    """The SMA window the spectrum suggests: its first zero 1/N at the knee where the power meets the jitter floor.

    The floor is the median power of the upper half of the frequencies; the knee the lowest frequency whose power is
    within 2x of it. Below the knee is drift (kept), above it jitter (cut). N is clipped to [2, max_n].
    """
    positive = freqs > 0
    f, p = freqs[positive], power[positive]
    floor = float(np.median(p[len(p) // 2 :]))
    knee = float(f[np.argmax(p <= 2 * floor)]) if np.any(p <= 2 * floor) else float(f[-1])
    n = int(min(max(2, round(1 / knee)), max_n))
    return {"knee_frequency": knee, "floor": floor, "n": n}


def experiment_spectrum(run_dir: Path, warmup_tokens: int, n: int) -> dict[str, Any] | None:
    """RUN/spectrum.json from the constant-LR run's stable-phase snapshots (after warmup); None if too few."""
    from pmakit.snapshot import discover

    snaps = [s for s in discover(snapshots_dir(run_dir / MAIN_RUN)) if s.tokens > warmup_tokens]
    if len(snaps) < max(8, 2 * n):
        log.info("spectrum: %d stable-phase snapshots, too few for a spectrum; skipped", len(snaps))
        return None
    path = run_dir / "spectrum.json"
    with contextlib.suppress(OSError, ValueError):
        previous = json.loads(path.read_text())
        if previous.get("snapshots") == [s.tokens for s in snaps] and f"SMA N={n}" in previous["filters"]:
            log.info("spectrum: already done")
            return dict(previous)
    record = spectrum(snaps, n)
    atomic_write_json(run_dir / "spectrum.json", record, indent=None)
    return record
