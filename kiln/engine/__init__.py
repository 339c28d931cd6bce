"""The generation engine: continuous batching over a paged KV cache, sampling, stop strings (issue 39)."""
