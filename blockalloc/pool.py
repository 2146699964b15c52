"""Fixed pool of KV-cache blocks with reference counts and an LRU prefix cache.

Every block is in exactly one of three states:

- free: ref count 0, no hash; lives in `_free`.
- evictable: ref count 0, hashed; lives in `_evictable` (LRU order, oldest first). Its KV
  content is still valid, so `lookup` can revive it, but `allocate` may reclaim it.
- used: ref count > 0, hashed or not.

Callers should free a request's blocks in reverse order (tail first). Freed blocks join the
most-recently-used end of the LRU, so freeing tail first leaves the prefix heads as the most
recent and they are evicted last; heads are the blocks other requests are most likely to share,
and a tail block is useless once its head is gone since lookup matches prefixes only.
"""

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence


class BlockPool:
    """Hands out block ids 0..num_blocks-1; every operation is O(1) or O(len(argument))."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        # Counted in blocks: how many hashes were looked up and how many of them hit.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._ref = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # hash -> block
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks `allocate` could hand out now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks with ref count > 0."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return len(self._cached)

    def allocate(self, n: int) -> list[int] | None:
        """Return `n` fresh blocks with ref count 1, or None (allocating nothing) if too few.

        Never-cached blocks go first so that cached content survives as long as possible;
        after that the least recently used evictable blocks are reclaimed and lose their hash.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks: {n}")
        if n > self.num_free:
            return None
        blocks: list[int] = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._uncache(block)
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference on each block; pass a request's blocks tail first (see module doc).

        Raises ValueError, changing nothing, if any block would drop below zero (double free).
        """
        blocks = list(blocks)
        # Validate everything first so a bad call cannot leave the pool half-updated.
        for block, count in Counter(blocks).items():
            self._check_block(block)
            if self._ref[block] < count:
                raise ValueError(f"double free of block {block}")
        for block in blocks:
            self._ref[block] -= 1
            if self._ref[block] > 0:
                continue
            if self._hash_of[block] is None:
                self._free.append(block)
            else:
                self._evictable[block] = None

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Return the blocks of the longest cached prefix of `hashes`, one reference taken on each."""
        self.prefix_queries += len(hashes)
        blocks: list[int] = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
            blocks.append(block)
        self.prefix_hits += len(blocks)
        return blocks

    def register(self, block: int, block_hash: int) -> None:
        """Cache an in-use, fully written `block` under `block_hash`.

        If another block already holds `block_hash`, that one is kept and `block` stays
        uncached: two copies of one prefix cannot both be found, so one hash, one block.
        """
        self._check_block(block)
        if self._ref[block] == 0:
            raise ValueError(f"cannot register block {block}: it is not in use")
        if not self.enable_prefix_cache:
            return
        current = self._hash_of[block]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block} is already cached under another hash")
            return
        if block_hash in self._cached:
            return
        self._cached[block_hash] = block
        self._hash_of[block] = block_hash

    def ref_count(self, block: int) -> int:
        self._check_block(block)
        return self._ref[block]

    def reset_prefix_cache(self) -> None:
        """Forget the hashes of all unreferenced blocks; blocks in use keep theirs."""
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
            self._free.append(block)

    def check_invariants(self) -> None:
        """Raise RuntimeError if the bookkeeping is inconsistent. O(num_blocks): tests only."""
        free = set(self._free)
        evictable = set(self._evictable)
        used = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        if len(free) != len(self._free):
            raise RuntimeError("a block is on the free list twice")
        if any(r < 0 for r in self._ref):
            raise RuntimeError("negative ref count")
        if free & evictable or free & used or evictable & used:
            raise RuntimeError("a block is in two states at once")
        if len(free) + len(evictable) + len(used) != self.num_blocks:
            raise RuntimeError("free + evictable + used != num_blocks")
        if any(self._hash_of[b] is not None for b in free):
            raise RuntimeError("a free block still has a hash")
        if any(self._hash_of[b] is None for b in evictable):
            raise RuntimeError("an evictable block has no hash")
        for h, block in self._cached.items():
            if self._hash_of[block] != h:
                raise RuntimeError(f"hash {h} maps to block {block} whose hash differs")
        if sum(h is not None for h in self._hash_of) != len(self._cached):
            raise RuntimeError("a hashed block is missing from the cache index")
        if not self.enable_prefix_cache and self._cached:
            raise RuntimeError("prefix cache disabled but blocks are cached")
        if self.prefix_hits > self.prefix_queries:
            raise RuntimeError("more prefix hits than queries")

    def _uncache(self, block: int) -> None:
        block_hash = self._hash_of[block]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hash_of[block] = None

    def _check_block(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} out of range [0, {self.num_blocks})")
