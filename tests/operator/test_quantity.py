"""Canonical quantities: the cases of apimachinery's own quantity tests (parse, then emit)."""

from __future__ import annotations

import pytest

from kvferry.operator.quantity import QuantityError, canonical_quantity

# (written, what the API server writes back), from apimachinery's TestQuantityString
# alternates, TestQuantityParseEmit, TestNewSet and the rounding cases of TestQuantityParse.
CANONICAL = [
    ("1024Mi", "1Gi"), ("307200Ki", "300Mi"), ("1025024Mi", "1001Gi"), ("1024Gi", "1Ti"),
    ("6Ki", "6Ki"), ("1025", "1025"), ("5000m", "5"), ("0.5", "500m"), ("1000M", "1G"),
    ("0.001T", "1G"), ("1000u", "1m"), ("1.08", "1080m"), ("1080000000n", "1080m"),
    (".001e12", "1e9"), ("0.001e0", "1e-3"), ("1000e-12", "1e-9"), ("80e-3", "80e-3"),
    ("300e6", "300e6"), ("3e3", "3e3"), ("00", "0"), ("0Gi", "0"), ("1234567M", "1234567M"),
    (".001Ki", "1024m"), (".000001Ki", "1024u"), (".000000001Ki", "1024n"),
    (".000000000001Ki", "2n"), ("3.001n", "4n"), ("0.00000012345", "124n"), ("1.", "1"),
    ("1000", "1k"), ("1234000", "1234k"), ("1.5", "1500m"), ("1.5Gi", "1536Mi"),
    ("100.035Ki", "102435840m"), ("0.5Mi", "512Ki"), ("-9.01", "-9010m"), ("+2", "2"),
    (4, "4"), (1, "1"), (0, "0"), ("750m", "750m"), ("8Gi", "8Gi"), ("1.3E+6", "1300e3"),
]


@pytest.mark.parametrize(("written", "stored"), CANONICAL)
def test_canonical_form(written: str | int, stored: str) -> None:
    assert canonical_quantity(written) == stored


@pytest.mark.parametrize(("written", "stored"), CANONICAL)
def test_canonical_form_is_a_fixed_point(written: str | int, stored: str) -> None:
    assert canonical_quantity(stored) == stored


@pytest.mark.parametrize("bad", ["1.1.M", "0.1mi", "0.1am", "aoeu", ".5i", "1i", "-3.01e-", "", True, 1.5])
def test_not_a_quantity(bad: object) -> None:
    with pytest.raises(QuantityError):
        canonical_quantity(bad)  # type: ignore[arg-type]
