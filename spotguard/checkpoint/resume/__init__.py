"""The resume path: the newest good step found and loaded, each file read once, checked as it is read,
and only what the manifest vouches for."""
