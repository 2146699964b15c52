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

`events`, when set, hears every change of the cache's contents (blocks joining it, evicted
blocks, a reset), for KV events that prefix-aware routers follow; None costs one check.
"""

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Protocol


class CacheEvents(Protocol):
    """Where a pool reports what enters and leaves its prefix cache."""

    def stored(self, hashes: list[int], parent: int | None, token_ids: Sequence[int]) -> None:
        """Blocks that joined the cache, a run of one hash chain: ``hashes[0]`` follows
        ``parent``; ``token_ids`` holds their tokens, block after block."""

    def removed(self, hashes: list[int]) -> None:
        """Cached blocks evicted (their hashes are no longer found)."""

    def cleared(self) -> None:
        """Nothing is cached any more."""


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
        # Counted in tokens, as vLLM's prefix-cache counters: the tokens of the full blocks
        # looked up (a prompt's partial last block never is) and of the blocks found.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._ref = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # hash -> block
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.events: CacheEvents | None = None

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
                self._evict(block)
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference on each block; pass a request's blocks tail first (see module doc).

        Raises ValueError, changing nothing, if any block would drop below zero (double free).
        """
        blocks = list(blocks)
        ref, hash_of = self._ref, self._hash_of
        # Validate everything first so a bad call cannot leave the pool half-updated. A
        # request's blocks are distinct: only a repeat needs counting.
        repeats = len(set(blocks)) != len(blocks)
        for block, count in Counter(blocks).items() if repeats else zip(blocks, repeat(1)):
            if not 0 <= block < self.num_blocks:
                self._check_block(block)
            if ref[block] < count:
                raise ValueError(f"double free of block {block}")
        for block in blocks:
            ref[block] -= 1
            if ref[block] > 0:
                continue
            if hash_of[block] is None:
                self._free.append(block)
            else:
                self._evictable[block] = None

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Return the blocks of the longest cached prefix of `hashes`, one reference taken on each."""
        self.prefix_queries += len(hashes) * self.block_size
        blocks: list[int] = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
            blocks.append(block)
        self.prefix_hits += len(blocks) * self.block_size
        return blocks

    def cached_prefix(self, hashes: Sequence[int]) -> int:
        """How many of the leading ``hashes`` are cached; takes no reference, counts no query."""
        n = 0
        for h in hashes:
            if h not in self._cached:
                break
            n += 1
        return n

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

    def report_joined(
        self,
        blocks: Sequence[int],
        hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
    ) -> None:
        """Tell `events` which of ``blocks``, just offered to `register` under ``hashes`` in
        chain order (``hashes[0]`` follows ``parent``; ``token_ids`` are their tokens, block
        after block), joined the cache. Callers check `events` first: without a listener
        there is nothing to gather, and the hot path keeps a bare `register` loop."""
        events = self.events
        if events is None:
            return
        # A fresh block offered once holds its hash now only if it joined; one whose hash
        # another block holds did not. It ends a run, and the next run's parent is its hash,
        # which consumers already know.
        hash_of = self._hash_of
        joined = [hash_of[b] == h for b, h in zip(blocks, hashes, strict=True)]
        bs = self.block_size
        start = 0
        for end in range(len(joined) + 1):
            if end < len(joined) and joined[end]:
                continue
            if start < end:
                run_parent = hashes[start - 1] if start else parent
                events.stored(list(hashes[start:end]), run_parent, token_ids[start * bs : end * bs])
            start = end + 1

    def ref_count(self, block: int) -> int:
        self._check_block(block)
        return self._ref[block]

    def reset_prefix_cache(self) -> None:
        """Forget the hashes of all unreferenced blocks; blocks in use keep theirs."""
        dropped: list[int] = []
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            dropped.append(self._uncache(block))
            self._free.append(block)
        if self.events is None:
            return
        # "All cleared" would be false while blocks in use stay findable: name the dropped.
        if not self._cached:
            self.events.cleared()
        elif dropped:
            self.events.removed(dropped)

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

    def _evict(self, block: int) -> None:
        block_hash = self._uncache(block)
        if self.events is not None:
            self.events.removed([block_hash])

    def _uncache(self, block: int) -> int:
        """Drop an evictable (so hashed) block's hash from the cache; returns the hash."""
        block_hash = self._hash_of[block]
        del self._cached[block_hash]
        self._hash_of[block] = None
        return block_hash

    def _check_block(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} out of range [0, {self.num_blocks})")
