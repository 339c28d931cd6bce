"""Interop with transformers: export HF directories, verify them bit for bit, the verify matrix.

This package is the only part of kiln (besides tests and benchmarks) that imports transformers,
and only lazily: `kiln.interop.export` works without it.
"""
