"""In-process recovery: the survivors of a departure or a loss go on in their processes (`spotguard.run`)."""

from spotguard.inprocess.context import Context, Recovery
from spotguard.inprocess.runner import run

__all__ = ["Context", "Recovery", "run"]
