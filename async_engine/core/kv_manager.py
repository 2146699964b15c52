"""A request's view of the block pool: append-only block tables and prefix-cache hashes."""

from __future__ import annotations

from async_engine.core.request import Request
from async_engine.core.row_table import RowTable
from blockalloc import BlockPool, block_hashes


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, rows: RowTable) -> None:
        self.pool = pool
        self.block_size = block_size
        self.rows = rows  # the counters of requests with rows: block counts kept there too

    def blocks_needed(self, req: Request, n: int) -> int:
        """Blocks ``req`` lacks for ``n`` more tokens past those computed and the draft slots
        in flight (which may all be verified)."""
        bs = self.block_size
        end = req.num_computed_tokens + req.num_drafts_inflight + n
        return -(-end // bs) - len(req.block_ids)

    def allocate_slots(self, req: Request, n: int) -> bool:
        """Grow the request's append-only block table to hold n more tokens; False: preempt."""
        need = self.blocks_needed(req, n)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        req.block_ids.extend(blocks)
        self.rows.set_blocks(req)
        return True

    def lookup_prefix(self, req: Request) -> None:
        full = self._reusable_blocks(req)
        if full is None:
            return
        hits = self.pool.lookup(req.hash_chain[:full])
        req.block_ids = hits
        req.block_hashes = req.hash_chain[: len(hits)]
        self.rows.set_computed(req, len(hits) * self.block_size)
        self.rows.set_blocks(req)
        if not req.output_ids and req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed_tokens

    def tokens_to_compute(self, req: Request) -> int:
        """The tokens a waiting ``req`` would compute were it admitted now (its prompt less
        the prefix the cache holds)."""
        full = self._reusable_blocks(req)
        cached = 0 if full is None else self.pool.cached_prefix(req.hash_chain[:full])
        return req.num_tokens - cached * self.block_size

    def _reusable_blocks(self, req: Request) -> int | None:
        """How many of a waiting request's full blocks the prefix cache may give it (their
        hashes made), None where it must compute them all."""
        # Leave at least one token to compute: its logits give the next token. A request
        # that scores its prompt computes all of it: a cached block's logits are not kept.
        if req.prompt_scores is not None and None in req.prompt_scores[1:]:
            return None
        full = (req.num_tokens - 1) // self.block_size
        self._hash_up_to(req, full)
        return full

    def register_full_blocks(self, req: Request, known: int | None = None) -> None:
        """Offer the request's blocks filled so far to the prefix cache. ``known``: tokens
        both computed and known (by default from the request's counters)."""
        bs = self.block_size
        if known is None:
            known = min(req.num_computed_tokens, req.num_tokens)
        full = known // bs
        if len(req.block_hashes) >= full:
            return
        self._hash_up_to(req, full)
        first = len(req.block_hashes)
        for h in req.hash_chain[first:full]:
            self.pool.register(req.block_ids[len(req.block_hashes)], h)
            req.block_hashes.append(h)
        self.rows.set_blocks(req)
        if self.pool.events is not None:  # KV events for routers: which blocks joined
            parent = req.hash_chain[first - 1] if first else None
            tokens = req.tokens_between(first * bs, full * bs)
            self.pool.report_joined(
                req.block_ids[first:full], req.hash_chain[first:full], parent, tokens
            )

    def _hash_up_to(self, req: Request, full: int) -> None:
        """Extend the request's hash chain to its first ``full`` blocks."""
        chain, bs = req.hash_chain, self.block_size
        if len(chain) < full:
            parent = chain[-1] if chain else None
            chain += block_hashes(req.tokens_between(len(chain) * bs, full * bs), bs, parent)

    def release(self, req: Request) -> None:
        self.free(self.detach(req))

    def detach(self, req: Request) -> list[int]:
        """Take the request's blocks away from it without freeing them yet (tail first)."""
        blocks = req.block_ids[::-1]
        req.block_ids = []
        req.block_hashes = []
        self.rows.set_blocks(req)
        return blocks

    def free(self, blocks: list[int]) -> None:
        # Tail first (as detach orders them), so that shared prefix heads are evicted last.
        self.pool.free(blocks)
