"""Byte sizes as users write them (``64KiB``, ``1.5GB``, ``40GiB``) and the offload defaults.

A leaf module (stdlib only), shared by the config (offload caps), the offload engine and
the planner (memory budgets).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

DEFAULT_OFFLOAD_MIN_BYTES = 64 * 2**10
"""Saved tensors whose storage is smaller stay resident: their copies cost more than they free."""

DEFAULT_HOST_CAP_BYTES = 16 * 2**30
"""Default cap of the pinned host pool; past it, offload falls back to pageable buffers."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def parse_bytes(value: int | float | str, *, round_down: bool = False) -> int:
    """``'64KiB'`` -> ``65536``; ``'1.5GB'`` -> ``1500000000``; an int is taken as bytes.

    Raises ``ValueError`` naming the accepted forms for anything else (negative numbers,
    unknown units, fractions of a byte). With ``round_down`` a size that comes to a fraction
    of a byte (a budget such as ``'71.96GiB'``) is rounded down to whole bytes instead
    (``rounding_note`` says so in words).
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size, got {value!r}; write e.g. 65536, '64KiB' or '1.5GB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte size {value} is negative; sizes are 0 or more")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0 or (value != int(value) and not round_down):
            raise ValueError(f"byte size {value} is not a whole, non-negative number of bytes")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a byte size, got {type(value).__name__}; write e.g. '64KiB'")
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {value!r} as a byte size; write a number with an optional unit: "
            "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '40GiB'"
        )
    nbytes = _exact(match.group(1), unit)
    if nbytes != nbytes.to_integral_value() and not round_down:
        raise ValueError(f"{value!r} is not a whole number of bytes; give a size that comes to whole bytes")
    return int(nbytes)  # towards zero: down, for a size


def _exact(number: str, unit: str) -> Decimal:
    # Decimal, not float: '2.01KB' is exactly 2010 bytes, and 2.01 * 1000 is not in binary floats.
    return Decimal(number) * _UNITS[unit]


def rounding_note(value: int | float | str) -> str | None:
    """What ``parse_bytes(value, round_down=True)`` rounded away, in words (``None`` when the
    size is whole bytes): ``"71.96GiB is 77,266,363,023.36 bytes; taken as 77,266,363,023"``."""
    if isinstance(value, float) and math.isfinite(value) and value >= 0 and value != int(value):
        exact = Decimal(value)
    elif isinstance(value, str) and (match := _SIZE.match(value)) and match.group(2).lower() in _UNITS:
        exact = _exact(match.group(1), match.group(2).lower())
    else:
        return None
    if exact == exact.to_integral_value():
        return None
    return f"{str(value).strip()} is {exact:,.2f} bytes; taken as {int(exact):,}, rounded down to whole bytes"


def format_bytes(nbytes: int) -> str | int:
    """The shortest exact form: ``65536`` -> ``'64KiB'``, ``1000`` -> ``1000``."""
    for suffix, scale in _BINARY:
        if nbytes and nbytes % scale == 0:
            return f"{nbytes // scale}{suffix}"
    return nbytes


def mib(nbytes: float | None) -> str:
    """Bytes as MiB for tables: ``'1,234.5'``; ``'-'`` for ``None``."""
    return "-" if nbytes is None else f"{nbytes / 2**20:,.1f}"


def human_bytes(nbytes: float) -> str:
    """Bytes with a unit for messages: GiB from 1 GiB up (``'1.500 GiB'``), else ``'12.5 MiB'``."""
    return f"{nbytes / 2**30:.3f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
