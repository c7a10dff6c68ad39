"""The bytes' plumbing both paths (and the snapshots) use: checksummed file I/O, pinned bounce buffers,
host staging, transfers that race a deadline, and the progress lines of long ones."""
