"""Radix tree over cached blocks: nodes and their edits, the evictable-leaf index, integrity check."""
