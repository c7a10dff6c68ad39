"""Moves between tiers and between ranks: local -> object store (streamed or after the commit), a
leaving rank's shards into a survivor's memory (handoff) and the survivors' save without it."""
