"""Parse and format token counts ("500M", "4B", "1.5T") and byte sizes ("5GB", "512MB")."""

from __future__ import annotations

import math
import re

from pmakit.errors import PmakitError

_TOKEN_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTE_SUFFIX = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def _parse(text: str | int, suffixes: dict[str, int], what: str) -> int:
    if isinstance(text, int):
        return text
    match = _NUMBER.match(str(text))
    suffix = match.group(2).upper() if match else ""
    if not match or suffix not in suffixes:
        known = ", ".join(s for s in suffixes if s)
        raise PmakitError(f"cannot read {what} {text!r}: use a number with an optional suffix ({known})")
    value = float(match.group(1)) * suffixes[suffix]
    if not math.isfinite(value):
        raise PmakitError(f"cannot read {what} {text!r}: not a finite number")
    return round(value)


def parse_tokens(text: str | int) -> int:
    """'500M' -> 500_000_000, '4B' -> 4_000_000_000, '1.5T', '12000' (decimal suffixes K, M, B/G, T)."""
    return _parse(text, _TOKEN_SUFFIX, "token count")


def parse_size(text: str | int) -> int:
    """'5GB' -> 5_000_000_000 bytes (decimal KB/MB/GB/TB, binary KiB/MiB/GiB/TiB)."""
    return _parse(text, _BYTE_SUFFIX, "size")


def format_tokens(n: int | float) -> str:
    """12_500_000 -> '12.5M'."""
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g}{suffix}"
    return f"{n:g}"


def format_bytes(n: int | float) -> str:
    """1_610_612_736 -> '1.50 GiB'."""
    for suffix, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{int(n)} B"
