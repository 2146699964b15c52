"""Specification of blockalloc: the paged KV-cache block pool and its prefix cache."""

import pathlib
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from blockalloc import BlockPool, block_hashes

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "blockalloc"


def cached_pool(num_blocks: int, hashes: list[int], block_size: int = 4) -> BlockPool:
    """A pool whose first len(hashes) blocks are cached under `hashes` and then freed tail first."""
    pool = BlockPool(num_blocks, block_size)
    blocks = pool.allocate(len(hashes))
    for block, h in zip(blocks, hashes, strict=True):
        pool.register(block, h)
    pool.free(reversed(blocks))
    return pool


# --- package hygiene ---------------------------------------------------------------------------


# --- block_hashes ------------------------------------------------------------------------------


def test_block_hashes_covers_full_blocks_only():
    assert len(block_hashes(list(range(9)), 4)) == 2
    assert block_hashes([1, 2, 3], 4) == []


def test_block_hashes_are_unsigned_64_bit_ints():
    for h in block_hashes(list(range(40)), 4):
        assert 0 <= h < 2**64


def test_block_hashes_share_a_prefix_when_tokens_share_a_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4)
    assert a[0] == b[0]
    assert a[1] != b[1]


def test_block_hashes_differ_in_later_blocks_when_an_earlier_block_differs():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]


def test_block_hashes_depend_on_the_parent():
    tokens = [1, 2, 3, 4]
    assert block_hashes(tokens, 4) != block_hashes(tokens, 4, parent=0)
    assert block_hashes(tokens, 4, parent=1) != block_hashes(tokens, 4, parent=2)


def test_block_hashes_continue_a_chain_through_parent():
    whole = block_hashes(list(range(8)), 4)
    tail = block_hashes(list(range(4, 8)), 4, parent=whole[0])
    assert tail == whole[1:]


def test_block_hashes_are_stable_across_processes():
    code = "from blockalloc import block_hashes; print(block_hashes(list(range(8)), 4))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=PACKAGE_DIR.parent,
        env={"PYTHONHASHSEED": "12345"},
    ).stdout
    assert out.strip() == str(block_hashes(list(range(8)), 4))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"token_ids": [1], "block_size": 0},
        {"token_ids": [1], "block_size": 1, "parent": -1},
        {"token_ids": [1], "block_size": 1, "parent": 2**64},
        {"token_ids": [2**63], "block_size": 1},
    ],
)
def test_block_hashes_reject_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        block_hashes(**kwargs)


# --- allocate / free ---------------------------------------------------------------------------


def test_new_pool_is_all_free():
    pool = BlockPool(8, 4)
    assert (pool.num_blocks, pool.block_size) == (8, 4)
    assert (pool.num_free, pool.num_used, pool.num_cached) == (8, 0, 0)


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (-1, 4), (4, 0), (4, -2)])
def test_constructor_rejects_non_positive_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


def test_allocate_then_free_round_trips():
    pool = BlockPool(8, 4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3
    assert all(pool.ref_count(b) == 1 for b in blocks)
    assert (pool.num_free, pool.num_used) == (5, 3)
    pool.free(reversed(blocks))
    assert (pool.num_free, pool.num_used) == (8, 0)
    pool.check_invariants()


def test_allocate_zero_returns_empty_list():
    pool = BlockPool(2, 4)
    assert pool.allocate(0) == []
    assert pool.num_free == 2


def test_allocate_negative_raises():
    with pytest.raises(ValueError):
        BlockPool(2, 4).allocate(-1)


def test_allocation_that_cannot_be_met_returns_none_and_allocates_nothing():
    pool = cached_pool(4, [11])
    pool.allocate(2)
    assert pool.allocate(3) is None
    assert (pool.num_free, pool.num_used, pool.num_cached) == (2, 2, 1)
    pool.check_invariants()


def test_double_free_raises():
    pool = BlockPool(4, 4)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(ValueError, match="double free"):
        pool.free([block])


def test_free_of_the_same_block_twice_in_one_call_raises_and_changes_nothing():
    pool = BlockPool(4, 4)
    a, b = pool.allocate(2)
    with pytest.raises(ValueError):
        pool.free([b, a, a])
    assert pool.ref_count(a) == pool.ref_count(b) == 1
    pool.check_invariants()


@pytest.mark.parametrize("block", [-1, 4])
def test_out_of_range_block_ids_raise(block):
    pool = BlockPool(4, 4)
    for call in (lambda: pool.free([block]), lambda: pool.ref_count(block)):
        with pytest.raises(ValueError):
            call()
    with pytest.raises(ValueError):
        pool.register(block, 1)


# --- prefix cache ------------------------------------------------------------------------------


def test_lookup_returns_the_longest_cached_prefix():
    pool = cached_pool(8, [1, 2, 3])
    assert pool.lookup([1, 2, 99, 3]) == [0, 1]
    assert pool.lookup([99, 1]) == []


def test_lookup_revives_evictable_blocks_with_one_reference():
    pool = cached_pool(4, [1, 2])
    assert pool.num_free == 4
    blocks = pool.lookup([1, 2])
    assert [pool.ref_count(b) for b in blocks] == [1, 1]
    assert (pool.num_free, pool.num_used, pool.num_cached) == (2, 2, 2)
    pool.check_invariants()


def test_lookup_shares_a_block_already_in_use():
    pool = BlockPool(4, 4)
    [block] = pool.allocate(1)
    pool.register(block, 7)
    assert pool.lookup([7]) == [block]
    assert pool.ref_count(block) == 2


def test_lookup_counts_queries_and_hits_in_tokens():
    pool = cached_pool(8, [1, 2], block_size=4)
    pool.lookup([1, 2, 3])
    pool.lookup([5])
    assert (pool.prefix_queries, pool.prefix_hits) == (4 * 4, 2 * 4)  # as vLLM: tokens


def test_freed_cached_block_stays_cached_but_counts_as_free():
    pool = cached_pool(4, [1])
    assert (pool.num_free, pool.num_used, pool.num_cached) == (4, 0, 1)


def test_allocate_prefers_never_cached_blocks_over_evictable_ones():
    pool = cached_pool(4, [1, 2])
    assert pool.allocate(2) == [2, 3]
    assert pool.num_cached == 2


def test_allocate_evicts_least_recently_used_first_and_drops_its_hash():
    pool = cached_pool(3, [1, 2, 3])  # freed tail first: LRU order is 3, 2, 1
    assert pool.allocate(1) == [2]
    assert pool.lookup([1, 2, 3]) == [0, 1]
    assert pool.num_cached == 2


def test_freeing_tail_first_evicts_prefix_heads_last():
    pool = cached_pool(4, [1, 2, 3, 4])
    evicted = [pool.allocate(1)[0] for _ in range(4)]
    assert evicted == [3, 2, 1, 0]


def test_a_revived_block_moves_to_the_most_recently_used_end():
    pool = cached_pool(3, [1, 2, 3])  # LRU order: 2, 1, 0
    pool.free(pool.lookup([3]))  # block 2 alone, revived then freed again
    assert pool.allocate(2) == [1, 0]
    assert pool.lookup([3]) == [2]


def test_register_of_a_duplicate_hash_keeps_the_existing_block():
    pool = BlockPool(4, 4)
    a, b = pool.allocate(2)
    pool.register(a, 42)
    pool.register(b, 42)
    assert pool.num_cached == 1
    assert pool.lookup([42]) == [a]
    pool.free([b])
    assert pool.ref_count(b) == 0
    assert pool.num_cached == 1  # b went back uncached
    pool.check_invariants()


def test_register_twice_with_the_same_hash_is_a_no_op():
    pool = BlockPool(4, 4)
    [a] = pool.allocate(1)
    pool.register(a, 42)
    pool.register(a, 42)
    assert pool.num_cached == 1


def test_register_under_a_second_hash_raises():
    pool = BlockPool(4, 4)
    [a] = pool.allocate(1)
    pool.register(a, 42)
    with pytest.raises(ValueError):
        pool.register(a, 43)


def test_register_of_a_block_not_in_use_raises():
    with pytest.raises(ValueError):
        BlockPool(4, 4).register(0, 42)


def test_register_is_a_no_op_when_prefix_caching_is_disabled():
    pool = BlockPool(4, 4, enable_prefix_cache=False)
    [a] = pool.allocate(1)
    pool.register(a, 42)
    assert pool.num_cached == 0
    assert pool.lookup([42]) == []
    pool.free([a])
    assert pool.num_free == 4


def test_reset_prefix_cache_drops_only_unreferenced_hashes():
    pool = cached_pool(4, [1, 2])
    pool.lookup([1])
    pool.reset_prefix_cache()
    assert pool.num_cached == 1
    assert pool.lookup([1, 2]) == [0]
    assert pool.num_free == 3
    pool.check_invariants()


def test_check_invariants_detects_a_block_both_free_and_used():
    pool = BlockPool(4, 4)
    pool.allocate(1)
    pool._free.append(0)  # corrupt on purpose
    with pytest.raises(RuntimeError):
        pool.check_invariants()


def test_check_invariants_detects_a_hash_pointing_at_the_wrong_block():
    pool = BlockPool(4, 4)
    a, b = pool.allocate(2)
    pool.register(a, 1)
    pool._cached[1] = b  # corrupt on purpose
    with pytest.raises(RuntimeError):
        pool.check_invariants()


# --- properties --------------------------------------------------------------------------------

BLOCK_SIZE = 2


@dataclass(slots=True)
class Request:
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    registered: int = 0  # leading full blocks already offered to register()


class PoolMachine(RuleBasedStateMachine):
    """Requests over a tiny vocabulary share prefixes, so hits, evictions and OOMs all happen.

    `content` models what each block holds: the token prefix ending at that block. Any cache
    hit must hand back a block whose content equals the prefix being looked up.
    """

    enable_prefix_cache = True

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(8, BLOCK_SIZE, self.enable_prefix_cache)
        self.requests: list[Request] = []
        self.content: dict[int, tuple[int, ...]] = {}

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=8))
    def start_request(self, tokens: list[int]) -> None:
        hashes = block_hashes(tokens, BLOCK_SIZE)
        hits = self.pool.lookup(hashes)
        for i, block in enumerate(hits):
            assert self.content[block] == tuple(tokens[: (i + 1) * BLOCK_SIZE])
        needed = -(-len(tokens) // BLOCK_SIZE) - len(hits)
        free_before = self.pool.num_free
        fresh = self.pool.allocate(needed)
        if fresh is None:
            assert self.pool.num_free == free_before < needed
            self.pool.free(reversed(hits))
            return
        for i, block in enumerate(fresh, start=len(hits)):
            self.content[block] = tuple(tokens[: (i + 1) * BLOCK_SIZE])
        self.requests.append(Request(tokens, hits + fresh, registered=len(hits)))

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 100))
    def register_full_blocks(self, index: int) -> None:
        req = self.requests[index % len(self.requests)]
        hashes = block_hashes(req.tokens, BLOCK_SIZE)
        for i in range(req.registered, len(hashes)):
            self.pool.register(req.blocks[i], hashes[i])
        req.registered = len(hashes)

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 100), token=st.integers(0, 2))
    def decode_one_token(self, index: int, token: int) -> None:
        req = self.requests[index % len(self.requests)]
        if len(req.tokens) % BLOCK_SIZE == 0:
            fresh = self.pool.allocate(1)
            if fresh is None:
                return
            req.blocks += fresh
        else:
            # A partially written block must belong to this request alone.
            assert self.pool.ref_count(req.blocks[-1]) == 1
        req.tokens.append(token)
        self.content[req.blocks[-1]] = tuple(req.tokens)

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 100))
    def finish_request(self, index: int) -> None:
        req = self.requests.pop(index % len(self.requests))
        self.pool.free(reversed(req.blocks))

    @rule()
    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        self.pool.check_invariants()
        assert self.pool.num_free + self.pool.num_used == self.pool.num_blocks

    @invariant()
    def ref_counts_match_the_requests_holding_each_block(self) -> None:
        held = [0] * self.pool.num_blocks
        for req in self.requests:
            for block in req.blocks:
                held[block] += 1
        assert held == [self.pool.ref_count(b) for b in range(self.pool.num_blocks)]

    @invariant()
    def idle_pool_has_every_block_back(self) -> None:
        if not self.requests:
            assert self.pool.num_free == self.pool.num_blocks

    def teardown(self) -> None:
        while self.requests:
            self.finish_request(0)
        self.pool.check_invariants()
        assert self.pool.num_free == self.pool.num_blocks


class NoPrefixCacheMachine(PoolMachine):
    enable_prefix_cache = False

    @invariant()
    def nothing_is_ever_cached(self) -> None:
        assert self.pool.num_cached == 0 and self.pool.prefix_hits == 0


MACHINE_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = MACHINE_SETTINGS
TestNoPrefixCacheMachine = NoPrefixCacheMachine.TestCase
TestNoPrefixCacheMachine.settings = settings(MACHINE_SETTINGS, max_examples=50)
