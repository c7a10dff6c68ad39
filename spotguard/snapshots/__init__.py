"""Snapshots in the nodes' memory, replicated to other nodes, for losses that come without a notice.

`tier.SnapshotTier` makes them and resumes from them; `shard_file` is one rank's snapshot as a file,
`node_dir` a node's directory of them, `peers` the transfers between nodes, `recovery` the choice
of the snapshot to resume from.
"""
