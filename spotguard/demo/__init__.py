"""`spotguard demo` and the harness that runs several torchrun agents as nodes on one host.

Used by the CLI's `demo`, the tests and the benchmarks; the core package never imports it.
"""
