"""Deprecated: the ledger's typed records are `spotguard.goodput.records` now; this name still imports."""

import warnings

from spotguard.goodput.records import *  # noqa: F403

warnings.warn("spotguard.ledger_records moved to spotguard.goodput.records", DeprecationWarning, stacklevel=2)
