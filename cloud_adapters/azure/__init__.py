"""Azure metadata client, its emulator and its object store."""
