"""A request's view of the block pool: append-only block tables and prefix-cache hashes."""

from __future__ import annotations

from async_engine.core.request import Request
from blockalloc import BlockPool, block_hashes


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

    def blocks_needed(self, req: Request, n: int) -> int:
        bs = self.block_size
        return -(-(req.num_computed_tokens + n) // bs) - len(req.block_ids)

    def allocate_slots(self, req: Request, n: int) -> bool:
        """Grow the request's append-only block table to hold n more tokens; False: preempt."""
        need = self.blocks_needed(req, n)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        req.block_ids.extend(blocks)
        return True

    def lookup_prefix(self, req: Request) -> None:
        # Leave at least one token to compute: its logits give the next token.
        known = req.known_tokens(req.num_tokens - 1)
        req.block_hashes = block_hashes(known, self.block_size)
        hits = self.pool.lookup(req.block_hashes)
        req.block_ids = hits
        req.block_hashes = req.block_hashes[: len(hits)]
        req.num_computed_tokens = len(hits) * self.block_size
        if not req.output_ids and req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed_tokens

    def register_full_blocks(self, req: Request, known: int | None = None) -> None:
        """Offer the request's blocks filled so far to the prefix cache. ``known``: tokens
        both computed and known (by default from the request's counters)."""
        bs = self.block_size
        if known is None:
            known = min(req.num_computed_tokens, req.num_tokens)
        full = known // bs
        if len(req.block_hashes) >= full:
            return
        parent = req.block_hashes[-1] if req.block_hashes else None
        start = len(req.block_hashes) * bs
        new = block_hashes(req.tokens_between(start, full * bs), bs, parent)
        for h in new:
            self.pool.register(req.block_ids[len(req.block_hashes)], h)
            req.block_hashes.append(h)

    def release(self, req: Request) -> None:
        self.free(self.detach(req))

    def detach(self, req: Request) -> list[int]:
        """Take the request's blocks away from it without freeing them yet (tail first)."""
        blocks = req.block_ids[::-1]
        req.block_ids = []
        req.block_hashes = []
        return blocks

    def free(self, blocks: list[int]) -> None:
        # Tail first (as detach orders them), so that shared prefix heads are evicted last.
        self.pool.free(blocks)
