"""Torch-free prefix cache: identity and chained block hashes, block pool, radix tree, ghost list
and miss causes, per-request cache state, and the ``CacheManager`` facade (see README.md here)."""
