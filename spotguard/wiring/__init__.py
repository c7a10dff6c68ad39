"""The Guard's rooms: each wires one package below to the training loop (the facade is `spotguard.guard`)."""
