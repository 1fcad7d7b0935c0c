"""The one place pipatch checks a whole number or a yes/no value given by a caller.

Python keywords (``seeds=10``, ``batch_size=8``, ``fast=False``), command-line and magic
options (text: ``--seeds 10``) and browser clicks all reach these two functions, so a bad value
reads the same everywhere: one :class:`~pipatch.PipatchError` line naming the parameter, the
value given and what to give instead. This module imports nothing of pipatch but the error,
so any module may use it without an import cycle.
"""

from __future__ import annotations

import numbers
import re
from typing import Any

from .errors import PipatchError

__all__ = ["flag", "is_whole", "whole_number"]

# Base-10 digits only: int() would also take "1_000" and non-ASCII digits ("٣").
_DIGITS = re.compile(r"[+-]?[0-9]+")

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def _bounds(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in {minimum}..{maximum}"
    if minimum is not None:
        return f" ≥ {minimum}"
    if maximum is not None:
        return f" ≤ {maximum}"
    return ""


def is_whole(value: Any) -> bool:
    """Whether ``value`` is an integral number (a numpy integer too) and not a bool: what a
    count or an id may be."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def whole_number(value: Any, what: str, minimum: int | None = 0, maximum: int | None = None) -> int:
    """``value`` as an ``int`` within ``minimum..maximum``, or one line saying what to give.

    Parameters
    ----------
    value
        An ``int`` (or another integral number, such as a numpy integer), or text that reads
        as a base-10 integer (``"10"``, ``" -3 "``). ``True`` / ``False``, floats (even
        ``3.0``) and anything else are refused: a bool or a float passed for a count is a
        mistake, not a number to round.
    what
        The parameter's name as the caller knows it (``"seeds"``, ``"--batch-size"``).
    minimum, maximum
        The inclusive bounds; ``None`` for no bound on that side.

    Returns
    -------
    int
        The value, as a plain ``int``.

    Raises
    ------
    PipatchError
        ``"seeds must be a whole number ≥ 1, got 0"``; with both bounds
        ``"sender head 9 is out of range: use 0..3"``.
    """
    wanted = f"a whole number{_bounds(minimum, maximum)}"
    if is_whole(value):
        number = int(value)
    elif isinstance(value, str) and _DIGITS.fullmatch(value.strip()):
        number = int(value.strip())
    else:
        raise PipatchError(f"{what} must be {wanted}, got {value!r}")
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        if minimum is not None and maximum is not None:
            raise PipatchError(f"{what} {number} is out of range: use {minimum}..{maximum}")
        raise PipatchError(f"{what} must be {wanted}, got {value!r}")
    return number


def flag(value: Any, what: str) -> bool:
    """``value`` as a ``bool``, or one line saying what to give.

    Parameters
    ----------
    value
        ``True`` / ``False``, or text: ``true``/``yes``/``on``/``1`` or
        ``false``/``no``/``off``/``0``, in any case. Numbers and other objects are refused:
        ``fast="no"`` must not read as true because the string is not empty.
    what
        The parameter's name as the caller knows it (``"fast"``).

    Returns
    -------
    bool

    Raises
    ------
    PipatchError
        ``"fast must be True or False, got 'maybe'"``.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    raise PipatchError(f"{what} must be True or False, got {value!r}")
