"""Drop-ins for training frameworks: `lightning` (Trainer), `fabric` (Lightning Fabric loops), `hf`
(transformers' Trainer) and `accelerate`; `loop` is what the Fabric and Accelerate helpers share.

Each submodule imports its framework; this package imports nothing, so `import spotguard`
never needs one installed.
"""
