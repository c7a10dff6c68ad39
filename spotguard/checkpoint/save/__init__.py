"""The save path: the state written as DCP shards with their checksums, staged through reused buffers,
committed manifest last, old steps retired; in the background or racing a deadline."""
