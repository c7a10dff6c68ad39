"""spotguard: keep distributed PyTorch training alive on spot / preemptible VMs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cloud_adapters.notice import Notice

__version__ = "0.1.0"
__all__ = ["Guard", "Notice", "__version__"]

if TYPE_CHECKING:
    from spotguard.guard import Guard


def __getattr__(name: str) -> object:
    # Guard pulls in torch; importing it lazily keeps `spotguard watch` and the emulators light.
    if name == "Guard":
        from spotguard.guard import Guard

        return Guard
    raise AttributeError(f"module 'spotguard' has no attribute {name!r}")
