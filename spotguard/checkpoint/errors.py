"""The one error the checkpoint layer raises for a save or load that could not be done."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded (the message says which step, where and why)."""
