"""Numbers as people read them, one set for every command's output."""

from __future__ import annotations

_SI = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
_BINARY = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def si(value: float | None, unit: str = "", digits: int = 3) -> str:
    """2.1e10 -> '21 G' + unit."""
    if value is None:
        return "n/a"
    for factor, prefix in _SI:
        if abs(value) >= factor:
            return f"{value / factor:.{digits}g} {prefix}{unit}"
    return f"{value:.{digits}g} {unit}".rstrip()


def size(value: float | None) -> str:
    """Bytes in binary units: '1.54 GiB'."""
    if value is None:
        return "n/a"
    for factor, unit in _BINARY:
        if abs(value) >= factor:
            return f"{value / factor:.3g} {unit}"
    return f"{int(value)} B"


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.3g} ms"


def percent(value: float | None, *, fine_below: float = 0.1) -> str:
    """A share: two decimals below `fine_below`, one above ('' for None)."""
    if value is None:
        return ""
    return f"{value:.2%}" if abs(value) < fine_below else f"{value:.1%}"
