"""Paged KV-cache block pool with reference counts and prefix caching."""

from blockalloc.hashing import block_hashes
from blockalloc.pool import BlockPool

__all__ = ["BlockPool", "block_hashes"]
