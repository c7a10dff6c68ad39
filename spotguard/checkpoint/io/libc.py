"""Functions of the process's own C library through ctypes (a call releases the GIL), where there are some."""

from __future__ import annotations

import ctypes
import sys
from typing import Any


def libc_function(name: str, argtypes: list[Any], restype: Any = ctypes.c_int) -> Any | None:
    """The C library's `name` with its argument and result types set; None off Linux or where it is missing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None), name, None)  # the C library already loaded
    except OSError:
        return None
    if function is not None:
        function.argtypes = argtypes
        function.restype = restype
    return function
