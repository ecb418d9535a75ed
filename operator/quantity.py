"""Kubernetes resource quantities in the canonical form the API server stores.

The API server parses every quantity (`500m`, `1.5Gi`, `4`) and writes it back in canonical
form (`1.5` becomes `1500m`, `1.5Gi` becomes `1536Mi`, `2000` becomes `2k`). The operator
renders quantities that way too, so a child it applied compares equal to what it reads
back and an unchanged child is never written again. Rules, from apimachinery's
`resource.Quantity`:

- the suffix family is kept: decimal SI (`m`, ``, `k`, `M`, ...), binary SI (`Ki`, `Mi`,
  ...) or a decimal exponent (`e3`);
- the value is rounded up (away from zero) to a multiple of 1n (1e-9);
- the mantissa is the smallest integer, the suffix (a power of 1000, or of 1024) as large
  as it can be without losing precision;
- a binary SI value below 1024 in magnitude, or not a whole number, is written in decimal SI.
"""

from __future__ import annotations

import re
from fractions import Fraction

_DECIMAL_SI = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SI = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}  # powers of 1024
_DECIMAL_SUFFIX = {exp: suffix for suffix, exp in _DECIMAL_SI.items()}
_BINARY_SUFFIX = {power: suffix for suffix, power in _BINARY_SI.items()}
_QUANTITY = re.compile(r"^([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(.*)$")
_EXPONENT = re.compile(r"^[eE]([+-]?[0-9]+)$")
_NANO = 10**9


class QuantityError(ValueError):
    """Text that is not a Kubernetes quantity."""


def _parse(text: str) -> tuple[Fraction, str]:
    """(exact value, format) of a quantity; format is `decimal`, `binary` or `exponent`."""
    match = _QUANTITY.match(text)
    if match is None:
        raise QuantityError(f"{text!r} is not a quantity (e.g. 500m, 2, 8Gi)")
    sign, number, suffix = match.groups()
    value = Fraction(number) * (-1 if sign == "-" else 1)
    if suffix in _DECIMAL_SI:
        return value * Fraction(10) ** _DECIMAL_SI[suffix], "decimal"
    if suffix in _BINARY_SI:
        return value * 1024 ** _BINARY_SI[suffix], "binary"
    exponent = _EXPONENT.match(suffix)
    if exponent is None:
        raise QuantityError(f"{text!r} has an unknown suffix {suffix!r}")
    return value * Fraction(10) ** int(exponent.group(1)), "exponent"


def _round_up_to_nano(value: Fraction) -> int:
    """The value in units of 1e-9, rounded away from zero."""
    nanos = abs(value) * _NANO
    whole = -(-nanos.numerator // nanos.denominator)  # ceiling of a positive fraction
    return whole if value >= 0 else -whole


def _decimal(nanos: int, fmt: str) -> str:
    # Strip trailing zeros into the exponent, then lower the exponent to a multiple of
    # three: 1500000000n -> 15e8n = 15e-1 -> 1500e-3 -> "1500m".
    mantissa, exponent = nanos, -9
    while mantissa % 10 == 0:
        mantissa //= 10
        exponent += 1
    shift = exponent % 3
    mantissa, exponent = mantissa * 10**shift, exponent - shift
    if fmt == "exponent":
        return f"{mantissa}" if exponent == 0 else f"{mantissa}e{exponent}"
    if exponent in _DECIMAL_SUFFIX:
        return f"{mantissa}{_DECIMAL_SUFFIX[exponent]}"
    return f"{mantissa}e{exponent}"


def _binary(value: int) -> str:
    mantissa, power = value, 0
    while mantissa % 1024 == 0 and power < max(_BINARY_SUFFIX):
        mantissa //= 1024
        power += 1
    return f"{mantissa}{_BINARY_SUFFIX.get(power, '')}"


def canonical_quantity(value: str | int) -> str:
    """The quantity as the API server writes it back, e.g. `"0.5"` -> `"500m"`, `4` -> `"4"`."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise QuantityError(f"{value!r} is not a quantity")
    exact, fmt = _parse(str(value).strip())
    nanos = _round_up_to_nano(exact)
    if nanos == 0:
        return "0"
    if fmt == "binary" and nanos % _NANO == 0 and abs(nanos) >= 1024 * _NANO:
        return _binary(nanos // _NANO)
    return _decimal(nanos, "exponent" if fmt == "exponent" else "decimal")
