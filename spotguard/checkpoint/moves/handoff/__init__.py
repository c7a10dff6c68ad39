"""Leaving ranks hand the shards that exist nowhere else to a survivor's memory, over TCP.

Each survivor that expects a handoff listens on the address it reaches the job's store
from, and publishes `host port token` in the store (`departure`). A leaving rank connects
and sends, in order: a JSON hello (token, rank, step), a JSON
header (one entry per shard: name, offsets, sizes, dtype, bytes), the bytes of each shard
in chunks, and a JSON trailer with each shard's CRC32C. The survivor checksums the bytes
as they arrive and answers `{"ok": true}` or why not; only then is the leaving rank free
to go. Nothing is pickled, and a connection without the token is dropped. Until its hello
proves it one of the expected senders, a connection costs the survivor no thread, a few
seconds at most and one of a few places; a failed accept() is survived.

The survivors' coordinator publishes the outcome of the save (`Departure.publish_outcome`), so
a leaving rank can tell the truth about a checkpoint it no longer takes part in.
"""

from spotguard.checkpoint.moves.handoff.receive import ReceivePool, Receiver, sharded_nbytes
from spotguard.checkpoint.moves.handoff.send import send_shards
from spotguard.checkpoint.moves.handoff.wire import Shards, advertised_host

__all__ = ["ReceivePool", "Receiver", "Shards", "advertised_host", "send_shards", "sharded_nbytes"]
