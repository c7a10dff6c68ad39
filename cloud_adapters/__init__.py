"""How to talk to each cloud: interruption notices, metadata emulators and object stores.

Knows nothing of torch or training; `spotguard` builds on it, never the reverse.
"""

from cloud_adapters.notice import INTERRUPTION, MAINTENANCE, REBALANCE, Notice, NoticeSource, NoticeSourceError
from cloud_adapters.storage import ObjectStore, open_store

__all__ = [
    "INTERRUPTION",
    "MAINTENANCE",
    "REBALANCE",
    "Notice",
    "NoticeSource",
    "NoticeSourceError",
    "ObjectStore",
    "open_store",
]
