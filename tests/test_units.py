import pytest

from pmakit.errors import PmakitError
from pmakit.units import format_bytes, format_tokens, parse_size, parse_tokens


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("500M", 500_000_000),
        ("4B", 4_000_000_000),
        ("1.5T", 1_500_000_000_000),
        ("12000", 12_000),
        ("2k", 2_000),
        ("1e6", 1_000_000),
        (7, 7),
    ],
)
def test_parse_tokens(text: str, value: int) -> None:
    assert parse_tokens(text) == value


@pytest.mark.parametrize(
    ("text", "value"),
    [("5GB", 5 * 10**9), ("512MB", 512 * 10**6), ("1GiB", 2**30), ("100", 100), ("64KiB", 65536)],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "abc", "4X", "1.2.3", "-5M"])
def test_parse_rejects(bad: str) -> None:
    with pytest.raises(PmakitError, match="cannot read"):
        parse_tokens(bad)


def test_format() -> None:
    assert format_tokens(12_500_000) == "12.5M"
    assert format_tokens(4_000_000_000) == "4B"
    assert format_bytes(3 * 2**30 // 2) == "1.50 GiB"
