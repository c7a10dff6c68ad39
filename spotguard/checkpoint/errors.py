"""The errors the checkpoint layer raises for a save or load that could not be done."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded (the message says which step, where and why)."""


class CheckpointUnavailable(CheckpointError):
    """Committed checkpoints may exist but could not be read in time (the store was unreachable or failing).

    Raised by resume instead of starting afresh: a fresh start would throw the saved progress away.
    """


class Damaged(CheckpointError):
    """A file read by a load did not match its manifest record (what was copied from it into the state is wrong)."""
