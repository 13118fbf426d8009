"""Number formatting shared by every part of the report, so that one quantity always looks the same.

Losses, standard errors, deltas and gaps: 4 decimals. z-scores: 1 decimal. Fractions: whole percent. Tokens:
4 significant digits with a K/M/B suffix. A missing number is shown as an en dash, never as 0 or NaN.
"""

from __future__ import annotations

from pmakit.units import format_tokens

MISSING = "–"


def loss(x: float | None) -> str:
    """3.1234"""
    return MISSING if x is None else f"{x:.4f}"


def signed(x: float | None) -> str:
    """+0.0123 / -0.0123"""
    return MISSING if x is None else f"{x:+.4f}"


def loss_se(x: float | None, se: float | None) -> str:
    """3.1234 ± 0.0123 (the ± part only when the s.e. is known)."""
    if x is None:
        return MISSING
    return f"{x:.4f} ± {se:.4f}" if se is not None else f"{x:.4f}"


def signed_se(x: float | None, se: float | None, *, bound: bool = False) -> str:
    """+0.0123 ± 0.0021, or ± ≤0.0040 when only an upper bound of the s.e. is known."""
    if x is None:
        return MISSING
    if se is None:
        return f"{x:+.4f}"
    return f"{x:+.4f} ± {'≤' if bound else ''}{se:.4f}"


def z(x: float | None) -> str:
    """12.3"""
    return MISSING if x is None else f"{x:.1f}"


def percent(x: float | None, se: float | None = None, *, bound: bool = False) -> str:
    """0.876 -> 88%; with an s.e.: 88% (s.e. 3%); with an upper bound of it: 88% (s.e. ≤ 3%)."""
    if x is None:
        return MISSING
    text = f"{100 * x:.0f}%"
    return text + (f" (s.e. {'≤ ' if bound else ''}{100 * se:.0f}%)" if se is not None else "")


def tokens(x: int | float | None) -> str:
    """4194304 -> 4.194M"""
    return MISSING if x is None else format_tokens(x)


def interval(v: int | None, base: int | None) -> str:
    """V as a multiple of the base interval (2x) when it is one, else in tokens."""
    if v is None:
        return MISSING
    if base and v % base == 0:
        return f"{v // base}x"
    return format_tokens(v)


def seconds(x: float | None) -> str:
    """754.2 s (12.6 min)"""
    if x is None:
        return MISSING
    return f"{x:.1f} s" + (f" ({x / 60:.1f} min)" if x >= 120 else "")


def merge_label(row_label: str, method: str, n: int | None, v: int | None, base: int | None) -> str:
    """The row's own label when the experiment wrote one, else one built from its fields."""
    if row_label:
        return row_label
    parts = [method.upper() or "merge"]
    if n is not None:
        parts.append(f"N={n}")
    if v is not None:
        parts.append(f"V={interval(v, base)}")
    return " ".join(parts)
