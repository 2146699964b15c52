"""The drafters on their own: what each proposes from a row's tokens (and, for suffix
decoding, from finished requests)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streams.drafting.ahead import Chains, ChainsOnDevice, KeptChains, follow
from streams.drafting.ngram import NgramDrafter
from streams.drafting.suffix import MAX_CANDIDATES, SuffixDrafter


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


class SuffixByHand:
    """Suffix decoding's definition, token by token: the drafter drafts as this does.

    Every pair of consecutive tokens of the sequences kept, in the order the drafter indexes
    them (each call's rows in turn, then a release's): of the occurrences of a row's last
    pair, the ``MAX_CANDIDATES`` most recent are looked at."""

    def __init__(self, depth: int, max_cached: int, factor: float, min_prob: float) -> None:
        self.depth, self.max_cached = depth, max_cached
        self.factor, self.min_prob = factor, min_prob
        self.sequences: dict[int, list[int]] = {}  # the kept ones
        self.live: dict[int, int] = {}
        self.finished: list[int] = []
        # (the pair, its sequence, the offset of its second token there)
        self.order: list[tuple[tuple[int, int], int, int]] = []
        self.made = 0

    def _grow(self, seq: int | None, tokens: list[int], whole: bool) -> int:
        held = self.sequences.get(seq, [])
        grows = held and len(tokens) >= len(held) and tokens[len(held) - 1] == held[-1]
        if not grows or (whole and tokens[: len(held)] != held):
            self._forget(seq)
            self.made += 1
            seq, held = self.made, []
            self.sequences[seq] = held
        pairs = range(max(len(held), 1), len(tokens))
        self.order += [((tokens[end - 1], tokens[end]), seq, end) for end in pairs]
        held += tokens[len(held) :]
        return seq

    def propose(self, rows, tokens, ks):
        tokens = [t.tolist() for t in tokens]
        for row, seq in zip(rows, tokens, strict=True):
            self.live[row] = self._grow(self.live.get(row), seq, whole=False)
        return [self._draft(self.live[row], k) for row, k in zip(rows, ks, strict=True)]

    def release(self, row, tokens):
        live = self.live.pop(row, None)
        if self.max_cached == 0 or len(tokens) < 2:
            self._forget(live)
            return
        self.finished.append(self._grow(live, tokens.tolist(), whole=True))
        while len(self.finished) > self.max_cached:
            self._forget(self.finished.pop(0))

    def _forget(self, seq: int | None) -> None:
        self.sequences.pop(seq, None)
        self.order = [entry for entry in self.order if entry[1] != seq]

    def _draft(self, own: int, k: int) -> list[int]:
        seq = self.sequences[own]
        n = len(seq)
        if n < 2 or k <= 0:
            return []
        found = [(s, e) for pair, s, e in self.order if pair == (seq[-2], seq[-1])]
        matches = []
        for s, e in reversed(found[-MAX_CANDIDATES:]):
            if s == own and e >= n - 1:
                continue
            length, most = 0, min(self.depth, e + 1, n)
            while length < most and self._at(s, e - length) == seq[n - 1 - length]:
                length += 1
            matches.append((length, s, e))
        longest = max((m[0] for m in matches), default=0)
        matches = [(s, e) for length, s, e in matches if length == longest]
        draft = []
        for j in range(1, min(k, max(1, math.floor(self.factor * longest))) + 1 if matches else 0):
            votes: dict[int, int] = {}
            for s, e in matches:
                if e + j < len(self.sequences[s]):
                    votes[self._at(s, e + j)] = votes.get(self._at(s, e + j), 0) + 1
            if not votes:
                break
            token, count = max(votes.items(), key=lambda vote: vote[1])  # the first on a tie
            if count / len(matches) < self.min_prob:
                break
            draft.append(token)
            matches = [(s, e) for s, e in matches if self._at(s, e + j, e + j + 1) == [token]]
        return draft

    def _at(self, seq: int, start: int, stop: int | None = None):
        tokens = self.sequences[seq]
        return tokens[start] if stop is None else tokens[start:stop]


@settings(max_examples=60, deadline=None)
@given(
    depth=st.sampled_from([2, 3, 8, 24]),
    max_cached=st.sampled_from([0, 1, 3, 100]),
    factor=st.sampled_from([0.5, 1.0, 2.0, 4.0]),
    min_prob=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
    vocab=st.integers(3, 12),
    data=st.data(),
)
def test_suffix_drafts_as_its_definition_does(depth, max_cached, factor, min_prob, vocab, data):
    """Random rows that quote each other and themselves, grow, end, restart and take new
    requests, several rows a call; small vocabularies, so pairs recur past the candidates
    looked at."""
    drafter = SuffixDrafter(depth, max_cached, factor, min_prob)
    by_hand = SuffixByHand(depth, max_cached, factor, min_prob)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    rows: dict[int, np.ndarray] = {}
    quoted: list[np.ndarray] = [rng.integers(0, vocab, 40)]
    for _ in range(data.draw(st.integers(1, 30))):
        for row in data.draw(st.lists(st.integers(0, 5), max_size=3, unique=True)):
            if row in rows:  # it ends (sometimes with a last step the drafter never saw)
                ended = np.concatenate([rows.pop(row), rng.integers(0, vocab, rng.integers(0, 3))])
                drafter.release(row, ended)
                by_hand.release(row, ended)
                quoted.append(ended)
        calling = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True))
        for row in calling:
            source = quoted[rng.integers(len(quoted))]
            start = rng.integers(len(source))
            new = source[start : start + rng.integers(1, 12)]
            if rng.random() < 0.3:
                new = rng.integers(0, vocab, rng.integers(1, 4))
            held = rows.get(row, np.zeros(0, np.int64))
            if rng.random() < 0.05:  # handed other tokens than it held, as a replay's
                held = held[: rng.integers(len(held) + 1)][::-1].copy()
            rows[row] = np.concatenate([held, new]).astype(np.int64)
        ks = [int(rng.integers(0, 9)) for _ in calling]
        got = drafter.propose(calling, [rows[row] for row in calling], ks)
        want = by_hand.propose(calling, [rows[row] for row in calling], ks)
        assert [g.tolist() for g in got] == want
        assert all(g.dtype == np.int64 for g in got)


def test_suffix_looks_only_at_the_most_recent_occurrences():
    """Older occurrences are not looked at, even where they would match further back."""
    drafter = suffix()
    for row in range(6):
        drafter.release(row, a(9, 1, 2, 3))
    for row in range(6, 6 + MAX_CANDIDATES):
        drafter.release(row, a(8, 1, 2, 4))
    assert drafter.propose([99], [a(9, 1, 2)], [1])[0].tolist() == [4]
    drafter.release(99, a(5, 8, 1))  # one more recent occurrence of (8, 1): no change for (1, 2)
    drafter.release(100, a(7, 9, 1, 2, 3))  # one more of (1, 2): the longest match now
    assert drafter.propose([101], [a(9, 1, 2)], [1])[0].tolist() == [3]


def test_forgotten_requests_leave_nothing_behind():
    """What a drafter that forgot thousands of finished requests' tokens holds and drafts is
    what a drafter that only saw the requests kept holds and drafts."""
    rng = np.random.default_rng(0)
    requests = [rng.integers(0, 50, 300) for _ in range(40)]
    long_lived, fresh = suffix(max_cached_requests=3), suffix(max_cached_requests=3)
    live = rng.integers(0, 50, 2000)  # a row that lives through it all, growing
    for drafter, ended in ((long_lived, requests), (fresh, requests[-3:])):
        drafter.propose([7], [live[:1000]], [4])
        for row, tokens in enumerate(ended, start=100):  # rows other than the live one's
            drafter.release(row, tokens)

    def held(drafter: SuffixDrafter) -> dict:
        return {pair: len(entries) for pair, entries in drafter._index.items()}

    assert held(long_lived) == held(fresh)
    assert long_lived._top <= 2 * fresh._top + 2 * 600  # given-up places are packed away
    for quote in (requests[-1][100:140], requests[-3][:20], live[500:530], requests[0][50:80]):
        tokens = np.concatenate([live[:1000], quote])
        want = fresh.propose([7], [tokens], [6])[0].tolist()
        assert long_lived.propose([7], [tokens], [6])[0].tolist() == want


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
