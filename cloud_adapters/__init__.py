"""How to talk to each cloud: interruption notices, metadata emulators and object stores.

Knows nothing of torch or training; `spotguard` builds on it, never the reverse.
"""

from cloud_adapters.notice import INTERRUPTION, MAINTENANCE, REBALANCE, Notice, NoticeSource, NoticeSourceError
from cloud_adapters.storage import ObjectStore
from cloud_adapters.stores import check_location, open_store

__all__ = [
    "INTERRUPTION",
    "MAINTENANCE",
    "REBALANCE",
    "Notice",
    "NoticeSource",
    "NoticeSourceError",
    "ObjectStore",
    "check_location",
    "open_store",
]
