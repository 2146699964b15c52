"""The drafters on their own: what each proposes from a row's tokens (and, for suffix
decoding, from finished requests)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streams.drafting.ahead import Chains, ChainsOnDevice, KeptChains, follow
from streams.drafting.ngram import NgramDrafter
from streams.drafting.suffix import SuffixDrafter


def a(*tokens: int) -> np.ndarray:
    return np.array(tokens, np.int64)


# ------------------------------------------------------------------ ngram
def test_ngram_drafts_what_followed_the_latest_earlier_occurrence_of_the_suffix():
    drafter = NgramDrafter(prompt_lookup_min=2, prompt_lookup_max=4)
    tokens = a(1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 5, 1, 2, 3)
    assert drafter.lookup(tokens, 3).tolist() == [7, 7, 5]  # the later "1 2 3", not the first


def test_ngram_prefers_the_longest_suffix_it_finds():
    drafter = NgramDrafter(prompt_lookup_min=1, prompt_lookup_max=3)
    tokens = a(4, 5, 6, 1, 8, 6, 2, 4, 5, 6)  # "6" alone last occurs before 2; "4 5 6" before 1
    assert drafter.lookup(tokens, 2).tolist() == [1, 8]


def test_ngram_needs_a_suffix_of_at_least_its_minimum():
    drafter = NgramDrafter(prompt_lookup_min=3, prompt_lookup_max=4)
    assert drafter.lookup(a(1, 2, 9, 9, 1, 2), 3).tolist() == []  # only "1 2" repeats
    assert drafter.lookup(a(7, 1, 2, 9, 7, 1, 2), 3).tolist() == [9, 7, 1]


def test_ngram_drafts_at_most_k_and_nothing_without_a_match():
    drafter = NgramDrafter(prompt_lookup_min=1, prompt_lookup_max=2)
    assert drafter.lookup(a(1, 2, 3, 4, 5, 6, 1), 2).tolist() == [2, 3]
    assert drafter.lookup(a(1, 2, 3), 4).tolist() == []
    assert [d.tolist() for d in drafter.propose([0, 1], [a(1, 2, 1), a(3)], [2, 2])] == [[2, 1], []]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2), max_size=20), min_size=1, max_size=4),
    st.integers(1, 3),
    st.integers(0, 3),
    st.integers(1, 5),
)
def test_ngram_on_the_device_drafts_what_its_numpy_twin_drafts(rows, low, extra, k):
    """Every row at once, in torch ops of fixed shapes over a padded [rows, width] history,
    against the numpy lookup of each row alone (three-token alphabets: matches of every
    length, earlier and later, abound)."""
    import torch

    drafter = NgramDrafter(prompt_lookup_min=low, prompt_lookup_max=low + extra)
    width = max(len(r) for r in rows) + 3
    history = torch.full((len(rows), width), 7, dtype=torch.int32)  # 7: no token of the rows
    for i, tokens in enumerate(rows):
        history[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
    lengths = torch.tensor([len(r) for r in rows])
    drafts, counts = drafter.propose_on_device(history, lengths, k)
    for i, tokens in enumerate(rows):
        want = drafter.lookup(np.array(tokens, np.int64), k).tolist()
        assert drafts[i, : counts[i]].tolist() == want
        assert drafts[i, counts[i] :].tolist() == [0] * (k - int(counts[i]))


# ------------------------------------------------------------------ suffix decoding
def suffix(**overrides) -> SuffixDrafter:
    settings = {"max_tree_depth": 24, "max_cached_requests": 100, "max_spec_factor": 1.0}
    return SuffixDrafter(**{**settings, "min_token_prob": 0.1, **overrides})


def test_suffix_drafts_from_a_finished_request():
    drafter = suffix()
    drafter.release(0, a(5, 6, 7, 8, 9, 10, 11, 12))
    # Another request reaches "6 7 8": what followed it there is drafted, as long as the
    # match (three tokens) allows at one token of draft per matched token.
    assert drafter.propose([1], [a(1, 2, 6, 7, 8)], [5])[0].tolist() == [9, 10, 11]


def test_suffix_drafts_the_continuation_most_occurrences_agree_on():
    drafter = suffix(max_spec_factor=4.0)
    for row, tail in enumerate(([1, 1], [1, 1], [2, 2])):
        drafter.release(row, a(3, 4, 5, *tail))
    assert drafter.propose([9], [a(3, 4, 5)], [2])[0].tolist() == [1, 1]


def test_suffix_stops_where_no_continuation_has_its_minimum_share():
    drafter = suffix(max_spec_factor=4.0, min_token_prob=0.6)
    for row, tail in enumerate(([1, 7], [1, 8], [1, 9])):
        drafter.release(row, a(3, 4, 5, *tail))
    assert drafter.propose([9], [a(3, 4, 5)], [3])[0].tolist() == [1]  # then 7, 8, 9: a third each


def test_suffix_drafts_from_the_rows_own_earlier_tokens():
    drafter = suffix()
    assert drafter.propose([0], [a(1, 2, 3, 4, 9, 2, 3)], [2])[0].tolist() == [4, 9]


def test_a_row_taken_by_a_new_request_drafts_nothing_from_the_one_before():
    drafter = suffix()
    drafter.propose([0], [a(1, 2, 3, 4, 5, 6, 7, 8, 9, 10)], [2])
    drafter.release(0, a(1, 2, 3, 4, 5, 6, 7, 8, 9, 10))
    # The row's new request is short; its old tokens are now a finished request's, still
    # valid to draft from, never positions past the new request's own tokens.
    assert drafter.propose([0], [a(40, 41)], [2])[0].tolist() == []
    assert drafter.propose([0], [a(40, 41, 8, 9)], [1])[0].tolist() == [10]


def test_a_row_handed_other_tokens_than_it_held_drafts_from_those_alone():
    """As a replay on rows of its own would: no release, tokens that do not grow the row's."""
    drafter = suffix()
    drafter.propose([0], [a(1, 2, 3, 4, 5, 6, 7, 8, 9, 10)], [2])
    assert drafter.propose([0], [a(7, 8, 9, 11, 12, 7, 8)], [2])[0].tolist() == [9, 11]
    assert drafter.propose([0], [a(1, 2, 3)], [2])[0].tolist() == []


def test_suffix_forgets_the_oldest_finished_requests():
    drafter = suffix(max_cached_requests=1)
    drafter.release(0, a(5, 6, 7))
    drafter.release(1, a(1, 2, 3))
    assert drafter.propose([2], [a(9, 5, 6)], [1])[0].tolist() == []
    assert drafter.propose([3], [a(9, 1, 2)], [1])[0].tolist() == [3]


@pytest.mark.parametrize("k", [0, 1])
def test_suffix_drafts_at_most_k(k):
    drafter = suffix(max_spec_factor=8.0)
    drafter.release(0, a(1, 2, 3, 4, 5, 6))
    assert len(drafter.propose([1], [a(1, 2)], [k])[0]) == k


# ------------------------------------------------------------------ drafting ahead
def test_a_chain_drafts_what_follows_the_tokens_it_foresaw():
    chain = a(5, 6, 7, 8, 9)
    assert follow(chain, a(5, 6), 2).tolist() == [7, 8]
    assert follow(chain, a(), 3).tolist() == [5, 6, 7]
    assert follow(chain, a(5, 6, 7, 8), 4).tolist() == [9]  # what is left of it


def test_a_chain_that_foresaw_the_steps_in_flight_wrongly_is_no_draft():
    chain = a(5, 6, 7, 8, 9)
    assert follow(chain, a(5, 3), 2) is None
    assert follow(chain, a(5, 6, 7, 8, 9, 1), 2) is None  # the row outran it


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 2), max_size=6),  # tokens seen by the drafter
            st.lists(st.integers(0, 2), max_size=5),  # tokens it did not see
            st.lists(st.integers(0, 2), max_size=9),  # its chain
        ),
        min_size=1,
        max_size=4,
    ),
    st.integers(1, 4),
    st.booleans(),
)
def test_chains_on_the_device_keep_what_the_numpy_rule_keeps(rows, k, fallback):
    """Every row at once on the device, from its tokens there, against the simulated
    device's numpy twin (``follow`` for each row alone, and where it misses, prompt lookup's
    numpy twin over the row's tokens, or no draft); three-token alphabets: chains foresee
    and miss alike."""
    import torch

    missed = NgramDrafter(prompt_lookup_min=1, prompt_lookup_max=2) if fallback else None
    width = max(len(seen) + len(unseen) for seen, unseen, _ in rows) + 2
    history = np.full((len(rows), width), 7, np.int64)
    chains = Chains(
        np.zeros((len(rows), max(max(len(chain) for *_, chain in rows), 1)), np.int64),
        np.array([len(chain) for *_, chain in rows]),
        np.array([len(seen) for seen, *_ in rows]),
    )
    for i, (seen, unseen, chain) in enumerate(rows):
        history[i, : len(seen) + len(unseen)] = seen + unseen
        chains.tokens[i, : len(chain)] = chain
    lengths = [len(seen) + len(unseen) for seen, unseen, _ in rows]
    arrays = (chains.tokens, chains.lengths, chains.base)
    device = ChainsOnDevice(*(torch.from_numpy(a) for a in arrays), missed)
    drafts, counts = device.propose_on_device(
        torch.from_numpy(history).int(), torch.tensor(lengths), k
    )
    twin = KeptChains(chains, np.arange(len(rows)), missed)
    wanted = twin.propose(
        list(range(len(rows))), [history[i, :n] for i, n in enumerate(lengths)], [k] * len(rows)
    )
    for i, want in enumerate(wanted):
        assert drafts[i, : counts[i]].tolist() == want.tolist()
        assert drafts[i, counts[i] :].tolist() == [0] * (k - int(counts[i]))
