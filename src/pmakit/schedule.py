"""The warmup-stable-decay (WSD) learning-rate schedule, as a pure function of tokens.

PMA merges snapshots of the long constant-LR ("stable") phase; the decay at the end is what a merge predicts.
Units are tokens: batch sizes may change during a run, token counts do not lie.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pmakit.errors import PmakitError

DECAY_SHAPES = ("linear", "cosine", "1sqrt")


def wsd_multiplier(
    t: float,
    *,
    warmup: float,
    decay_start: float,
    decay_end: float,
    shape: str = "linear",
    floor: float = 0.0,
) -> float:
    """The LR multiplier at ``t``: linear warmup 0 -> 1 over ``warmup``, 1 until ``decay_start``, then down to
    ``floor`` at ``decay_end`` along ``shape`` (linear 1-x, cosine (1+cos(pi x))/2, 1sqrt 1-sqrt(x)), then ``floor``.

    Trainers evaluate it at the tokens seen after the step, so the first step has a non-zero LR.

    Example: warmup=10, decay_start=100, decay_end=200: t=5 -> 0.5, t=50 -> 1.0, t=150 -> 0.5 (linear), t=250 -> 0.
    """
    if t < warmup:
        # Warmup multiplies whatever the decay gives, so a decay that starts inside the warmup still applies.
        return (t / warmup) * _decay(t, decay_start, decay_end, shape, floor)
    return _decay(t, decay_start, decay_end, shape, floor)


def _decay(t: float, start: float, end: float, shape: str, floor: float) -> float:
    if t < start:
        return 1.0
    if t >= end:
        return floor
    x = (t - start) / (end - start)
    if shape == "linear":
        f = 1.0 - x
    elif shape == "cosine":
        f = (1.0 + math.cos(math.pi * x)) / 2.0
    elif shape == "1sqrt":
        f = 1.0 - math.sqrt(x)
    else:
        raise PmakitError(f"unknown decay shape {shape!r}; known: {', '.join(DECAY_SHAPES)}")
    return floor + (1.0 - floor) * f


@dataclass(frozen=True)
class WSD:
    """A WSD schedule in tokens. ``decay_start == decay_end`` (e.g. both at infinity) never decays."""

    peak_lr: float
    """The LR of the stable phase."""
    warmup: float = 0.0
    """Tokens of linear warmup from ~0 to ``peak_lr``."""
    decay_start: float = math.inf
    """Tokens at which the decay begins."""
    decay_end: float = math.inf
    """Tokens at which the LR reaches ``floor * peak_lr``."""
    shape: str = "linear"
    """Decay shape: linear, cosine or 1sqrt."""
    floor: float = 0.0
    """Final LR as a fraction of ``peak_lr``."""

    def __post_init__(self) -> None:
        if self.peak_lr <= 0 or not math.isfinite(self.peak_lr):
            raise PmakitError(f"the peak learning rate must be positive, got {self.peak_lr}")
        if self.warmup < 0 or self.decay_end < self.decay_start:
            raise PmakitError(
                f"bad WSD schedule: warmup {self.warmup}, decay {self.decay_start}..{self.decay_end} "
                "(need warmup >= 0 and decay_start <= decay_end)"
            )
        if self.shape not in DECAY_SHAPES:
            raise PmakitError(f"unknown decay shape {self.shape!r}; known: {', '.join(DECAY_SHAPES)}")
        if not 0 <= self.floor <= 1:
            raise PmakitError(f"the LR floor is a fraction of the peak in [0, 1], got {self.floor}")

    def multiplier(self, tokens: float) -> float:
        return wsd_multiplier(
            tokens,
            warmup=self.warmup,
            decay_start=self.decay_start,
            decay_end=self.decay_end,
            shape=self.shape,
            floor=self.floor,
        )

    def __call__(self, tokens: float) -> float:
        """The learning rate after ``tokens`` training tokens."""
        return self.peak_lr * self.multiplier(tokens)

    def phase(self, tokens: float) -> str:
        """warmup, stable, decay or done."""
        if tokens < self.warmup:
            return "warmup"
        if tokens < self.decay_start:
            return "stable"
        return "decay" if tokens < self.decay_end else "done"
