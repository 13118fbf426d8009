"""pmakit.lab.spectrum: window gains against closed forms, the spectrum of a known trajectory, the report section."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import write_snapshot
from pmakit.formats import read_state
from pmakit.lab.spectrum import experiment_spectrum, gain, power_spectrum, trajectory
from pmakit.snapshot import discover
from pmakit.weights import get_weights


def test_sma_gain_is_the_dirichlet_kernel_and_ema_the_one_pole_filter() -> None:
    f = np.linspace(0.01, 0.5, 50)
    n = 8
    expected = (np.sin(np.pi * f * n) / (n * np.sin(np.pi * f))) ** 2
    np.testing.assert_allclose(gain(get_weights("sma", n), f), expected, atol=1e-12)
    assert gain(get_weights("sma", n), np.array([0.0]))[0] == pytest.approx(1.0)
    # EMA over many snapshots -> the infinite one-pole filter alpha / (1 - (1 - alpha) e^{-2 pi i f})
    a = 0.2
    one_pole = a**2 / (1 - 2 * (1 - a) * np.cos(2 * np.pi * f) + (1 - a) ** 2)
    np.testing.assert_allclose(gain(get_weights("ema", 200, alpha=a), f), one_pole, rtol=1e-6)


def _run(root: Path, t: int = 40) -> tuple[Path, np.ndarray]:
    """Snapshots theta_t = slow drift + white jitter along a fixed direction, in an experiment-shaped run; and the
    coefficients c_t of that direction (theta_t = base + c_t * direction)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4096, generator=g)
    direction = torch.randn(4096, generator=g)
    coefficients = []
    for i in range(t):
        drift = np.sin(2 * np.pi * i / (4 * t))  # far below one cycle per window
        jitter = float(torch.randn((), generator=g))
        coefficients.append(5 * drift + 0.5 * jitter)
        state = {"w": base + coefficients[-1] * direction}
        write_snapshot(
            root / "main" / "snapshots" / f"step-{i + 1:04d}", state, step=i + 1, tokens=100 * (i + 1)
        )
    return root, np.asarray(coefficients)


def _removed_power(c: np.ndarray, weights: list[float]) -> float:
    """The share of the power of the series ``c`` above f = 0 that the merge ``weights`` (oldest first) removes,
    from numpy's DFT and the filter's response written out (independent of pmakit.lab.spectrum and scipy).

    Every bin k = 1..T-1 of the two-sided DFT (the negative frequencies counted as themselves, as a one-sided
    periodogram doubles them) weighted by 1 - |sum_j w_j e^(-2 pi i f_k j)|^2, j counted back from the newest.
    """
    power = np.abs(np.fft.fft(c - c.mean())) ** 2
    f = np.fft.fftfreq(len(c))
    lags = np.arange(len(weights))
    kept = np.abs(np.exp(-2j * np.pi * np.outer(f, lags)) @ np.asarray(weights[::-1])) ** 2
    return float((power[1:] * (1 - kept[1:])).sum() / power[1:].sum())


def test_drift_sits_low_and_jitter_spreads_flat(tmp_path: Path) -> None:
    run, coefficients = _run(tmp_path)
    snaps = discover(run / "main" / "snapshots")
    _, p = power_spectrum(trajectory(snaps))
    assert p[1:3].sum() > 10 * p[len(p) // 2 :].mean()  # the drift's power sits in the lowest bins
    record = experiment_spectrum(run, 0, 8)
    assert record is not None and (run / "spectrum.json").is_file()
    saved = json.loads((run / "spectrum.json").read_text())
    assert saved["snapshots"] == [s.tokens for s in snaps]
    sma = saved["filters"]["SMA N=8"]
    # what SMA keeps of the high band is its gain there: the jitter floor is cut, the drift is kept
    high = np.asarray(saved["frequencies"]) > 1 / 8
    assert np.asarray(sma["gain"])[high].max() < 0.06 and 0 < sma["removed_power"] < 1
    # The removed share follows from the coefficients alone: each snapshot is base + c_t * direction, so every
    # projection, its mean removed, is (d . direction) * (c_t - mean c): each direction's periodogram is P_c(f)
    # times a constant, and the share of power removed is P_c's, whatever the directions. The snapshots hold
    # theta_t in fp32 and the projections are fp32 dot products over 4096 entries: the deviations are off by a few
    # 1e-7 relative, the share by as much (4e-8 seen). rel=1e-5 leaves a wide margin and still tells apart another
    # window (SMA N=7 or 9: over 10%), a linear trend taken out before the periodogram or its one-sided inner
    # bins not doubled (0.5%).
    assert sma["weights"] == pytest.approx([1 / 8] * 8)
    assert sma["removed_power"] == pytest.approx(_removed_power(coefficients, [1 / 8] * 8), rel=1e-5)
    for label, filtered in saved["filters"].items():  # EMA and WSM too, from the weights the record names
        assert filtered["removed_power"] == pytest.approx(
            _removed_power(coefficients, filtered["weights"]), rel=1e-5
        ), label


def test_directions_kept_across_snapshots_give_the_same_projections(tmp_path: Path) -> None:
    # Each snapshot's projections on the directions drawn from the seed, tensor by tensor in sorted key order (an
    # integer buffer between the float tensors draws nothing): written out here, redrawn for every snapshot.
    g = torch.Generator().manual_seed(1)
    for i in range(5):
        state = {
            "b.w": torch.randn(33, 7, generator=g),
            "a.w": torch.randn(100, generator=g).to(torch.bfloat16),
            "a.steps": torch.tensor([i, 2 * i]),
            "c": torch.randn(3, generator=g),
        }
        write_snapshot(tmp_path / f"step-{i + 1:04d}", state, step=i + 1, tokens=10 * (i + 1))
    snaps = discover(tmp_path)
    expected = np.zeros((5, 4))
    for t, snap in enumerate(snaps):
        d = torch.Generator().manual_seed(3)
        state = read_state(snap.path)
        for name in ("a.w", "b.w", "c"):
            flat = state[name].reshape(-1).float()
            expected[t] += (torch.randn((4, flat.numel()), generator=d) @ flat).double().numpy()
        expected[t] /= np.sqrt(100 + 231 + 3)
    kept = trajectory(snaps, directions=4, seed=3)
    drawn = trajectory(snaps, directions=4, seed=3, keep_bytes=0)
    np.testing.assert_array_equal(kept, drawn)
    np.testing.assert_array_equal(kept, expected)
    assert not np.array_equal(trajectory(snaps, directions=4, seed=4), kept)


def test_experiment_report_has_the_spectrum(smoke_experiment: tuple[Path, str]) -> None:
    run, _ = smoke_experiment
    saved = json.loads((run / "spectrum.json").read_text())
    assert len(saved["power"]) == len(saved["frequencies"]) and saved["directions"] == 16
    report = (run / "report.md").read_text()
    assert "power spectrum" in report and (run / "plots" / "spectrum.png").is_file()


def test_the_window_suggested_cuts_at_the_knee_of_drift_and_floor() -> None:
    from pmakit.lab.spectrum import window_from_spectrum

    f = np.linspace(0, 0.5, 201)
    # drift 1/f^2 over a floor of 100
    power = np.where(f > 0, 1 / np.maximum(f, 1e-9) ** 2, 0) + 100
    found = window_from_spectrum(f, power, max_n=16)
    # floor = median of the upper half ~ 107; knee: 1/f^2 + 100 <= 214 -> f >= 0.094, the grid's 0.095 -> N = 11
    assert found["knee_frequency"] == pytest.approx(0.095) and found["n"] == 11
    assert window_from_spectrum(f, power, max_n=4)["n"] == 4
