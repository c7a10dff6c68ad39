"""Checks for values people pass in (Guard arguments, CLI flags, environment variables), in one
place so that every knob refuses the same things with the same one-line error.

NaN and infinity are refused wherever a finite number is meant: NaN compares false with
everything, so it slips through any `value <= 0` test (a NaN grace period loses the signal,
a NaN poll interval turns polling into a busy loop), and an infinite wait never ends.
A finite but huge number of seconds is refused too: it overflows the arithmetic it meets (a
deadline of now + 1e12 s is past datetime's year 9999, so SIGTERM's notice could not be made).
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

EXIT_STATUS_MAX = 255  # a process exit status is one byte: 256 would exit 0
# The most seconds any setting may hold: far above any real wait (a deadline, a poll, a save
# interval), far below the first overflow a wait meets: threading's TIMEOUT_MAX and a torch Store
# timeout (int64 nanoseconds: 292 years), a datetime deadline (now + about 7,900 years). A multiple
# of it (the watcher polls some advisories every 30th interval: 2.5 years) stays below them too.
MAX_SECONDS = 30 * 24 * 3600
MAX_SECONDS_SHOWN = f"30 days ({MAX_SECONDS} s)"


def seconds(name: str, value: Any) -> float:
    """A finite number of seconds > 0 and at most MAX_SECONDS, as a float."""
    number = positive(name, value, "number of seconds")
    if number > MAX_SECONDS:
        raise ValueError(f"{name} must be at most {MAX_SECONDS_SHOWN}, got {value!r}")
    return number


def positive(name: str, value: Any, what: str = "number") -> float:
    """A finite real number > 0, as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a {what}, not {type(value).__name__} ({value!r})")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite {what} > 0, got {value!r}")
    return float(value)


def count(name: str, value: Any, minimum: int = 1) -> int:
    """A whole number >= `minimum` (an int, or a numpy/torch integer; 1.5 and True are refused)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not bool ({value!r})")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(value).__name__} ({value!r})") from None
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def exit_status(name: str, value: Any) -> int:
    """A process exit status, 0 to 255."""
    status = count(name, value, minimum=0)
    if status > EXIT_STATUS_MAX:
        raise ValueError(f"{name} must be an exit status from 0 to {EXIT_STATUS_MAX}, got {status}")
    return status


def optional(check: Any, name: str, value: Any, *args: Any) -> Any:
    """`check(name, value)` unless `value` is None."""
    return None if value is None else check(name, value, *args)
