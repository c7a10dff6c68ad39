"""Drop-ins for training frameworks: `lightning`, `hf` (transformers' Trainer), `accelerate`.

Each submodule imports its framework; this package imports nothing, so `import spotguard`
never needs one installed.
"""
