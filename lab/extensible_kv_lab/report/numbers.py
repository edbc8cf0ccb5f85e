"""The report's one number format: ``number(value, unit)``. ``None`` is "not measured", ``True``/``False`` are
yes/no. Sizes are binary (GiB = 2**30, MiB = 2**20 bytes), rates decimal (GB/s = 1e9 bytes per second); times are
given in seconds and shown in ms or us."""

from __future__ import annotations

NOT_MEASURED = "not measured"
GIB, MIB = 1 << 30, 1 << 20

# unit -> (factor from the measured unit: bytes, seconds or a plain number; format spec)
UNITS = {
    "count": (1, ","),
    "GiB": (1 / GIB, ",.3f"),
    "MiB": (1 / MIB, ",.2f"),
    "ms": (1e3, ",.3f"),
    "us": (1e6, ",.1f"),
    "s": (1, ",.2f"),
    "GB/s": (1, ",.2f"),
    "tokens/s": (1, ",.0f"),
    "ratio": (1, ".4g"),
    "%": (1, ".3f"),
}


def number(value: object, unit: str = "count", signed: bool = False) -> str:
    """``value`` in ``unit`` (one of ``UNITS``; any other unit shows the value as it is)."""
    if value is None:
        return NOT_MEASURED
    if isinstance(value, bool):
        return "yes" if value else "no"
    if unit not in UNITS or not isinstance(value, (int, float)):
        return str(value)
    factor, spec = UNITS[unit]
    text = format(value * factor if factor != 1 else value, ("+" if signed else "") + spec)
    return f"{text} %" if unit == "%" else text


def sub(a: float | None, b: float | None) -> float | None:
    """``a - b``, ``None`` (not measured) where either is."""
    return None if a is None or b is None else a - b


def div(a: float | None, b: float | None) -> float | None:
    """``a / b``, ``None`` where ``a`` is not measured or ``b`` is not measured or zero."""
    return a / b if a is not None and b else None
