"""humanfriendly's ``format_size`` and ``format_timespan``, word for word, without importing it.

Importing humanfriendly takes about 10 ms (it loads inspect, decimal and
html.parser), a sixth of a small sync that prints its one summary line. The
command's reports say sizes and times as it does; tests/test_startup.py holds
the two to the same output. A timespan of a minute or more, where 10 ms no
longer shows, is humanfriendly's own.
"""

from __future__ import annotations

#: humanfriendly's units: (binary divider, symbol, decimal divider, symbol), largest first.
_UNITS = tuple((1024 ** power, binary, 1000 ** power, decimal) for power, binary, decimal in reversed((
    (1, "KiB", "KB"), (2, "MiB", "MB"), (3, "GiB", "GB"), (4, "TiB", "TB"), (5, "PiB", "PB"),
    (6, "EiB", "EB"), (7, "ZiB", "ZB"), (8, "YiB", "YB"))))


def _round(count: float) -> str:
    """humanfriendly's round_number: two decimals, trailing zeros (and point) dropped."""
    return ("%.2f" % float(count)).rstrip("0").rstrip(".")


def format_size(num_bytes: float, binary: bool = False) -> str:
    """``1.5 MiB``, ``12 bytes``, ``1 byte``: as :func:`humanfriendly.format_size`."""
    for binary_divider, binary_symbol, decimal_divider, decimal_symbol in _UNITS:
        divider, symbol = (binary_divider, binary_symbol) if binary else (decimal_divider, decimal_symbol)
        if num_bytes >= divider:
            return f"{_round(float(num_bytes) / divider)} {symbol}"
    return f"{num_bytes} {'byte' if float(num_bytes) == 1.0 else 'bytes'}"


def format_timespan(seconds: float) -> str:
    """``0.25 seconds``, ``1 second``: as :func:`humanfriendly.format_timespan`."""
    if seconds < 60:
        count = _round(seconds)
        return f"{count} {'second' if float(count) == 1.0 else 'seconds'}"
    from humanfriendly import format_timespan as longer

    return longer(seconds)


__all__ = ["format_size", "format_timespan"]
