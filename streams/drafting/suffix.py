"""Suffix decoding: drafts from every earlier occurrence of a row's recent tokens, in its own
prompt and output and in recently finished requests (agent loops repeat across requests,
not only within one).

An index maps each pair of consecutive tokens to where it occurs, in the live rows and in
up to ``max_cached_requests`` finished sequences. To propose, the occurrences of the row's
last two tokens are extended backwards while they match (up to ``max_tree_depth`` tokens);
the longest matches then vote, position by position, on what follows, as a walk down the
suffix tree of those occurrences would: the most frequent continuation is drafted while
its share of the surviving matches is at least ``min_token_prob``, and for at most
``max_spec_factor`` tokens per matched token (a longer match earns a longer draft).
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict

import numpy as np

from streams.drafting.ngram import NgramDrafter

MAX_CANDIDATES = 64  # occurrences of a pair looked at (the most recent ones)


class SuffixDrafter:
    # Asked for more tokens than a step's slots, it drafts past the tokens of the steps in
    # flight too, so a model runner need not wait for them; where it foresaw them wrongly,
    # ``missed`` (prompt lookup) drafts on the device instead (``streams.drafting.ahead``).
    drafts_ahead = True

    def __init__(
        self,
        max_tree_depth: int,
        max_cached_requests: int,
        max_spec_factor: float,
        min_token_prob: float,
        missed: NgramDrafter | None = None,
    ) -> None:
        self.missed = missed
        self.depth = max_tree_depth
        self.max_cached = max_cached_requests
        self.factor = max_spec_factor
        self.min_prob = min_token_prob
        # ("row", r, n): the n-th request on row r, live; ("done", n): the n-th that ended.
        # Lists: matching reads single tokens, which a numpy array hands out ten times slower.
        self._sequences: dict[object, list[int]] = {}
        self._live: dict[int, tuple] = {}  # row -> its live key
        self._indexed: dict[object, int] = {}  # tokens of each sequence in the index
        self._index: defaultdict[tuple[int, int], list[tuple[object, int]]] = defaultdict(list)
        self._finished: OrderedDict[object, None] = OrderedDict()  # oldest first
        self._ended = 0
        self._entries = 0  # in the index, forgotten sequences' included

    def propose(self, rows: list[int], tokens: list[np.ndarray], ks: list[int]) -> list[np.ndarray]:
        out = []
        for row, tokens_so_far, k in zip(rows, tokens, ks, strict=True):
            key = self._live.get(row)
            seq = self._sequences.get(key)
            held = 0 if seq is None else len(seq)
            # A live row's tokens only grow; others (a replay's) start the row afresh.
            grown = len(tokens_so_far) >= held and (not held or tokens_so_far[held - 1] == seq[-1])
            if seq is None or not grown:
                self._sequences.pop(key, None)
                self._indexed.pop(key, None)
                self._ended += 1
                key = self._live[row] = ("row", row, self._ended)
                seq, held = self._sequences.setdefault(key, []), 0
            seq.extend(tokens_so_far[held:].tolist())
            self._extend_index(key, seq)
            out.append(self._draft(key, seq, k))
        return out

    def release(self, row: int, tokens: np.ndarray) -> None:
        """The row's sequence joins the finished ones (the oldest are forgotten)."""
        live = self._live.pop(row, None)
        self._sequences.pop(live, None)
        self._indexed.pop(live, None)
        if self.max_cached == 0 or len(tokens) < 2:
            return
        self._ended += 1
        key = ("done", self._ended)
        self._sequences[key] = np.asarray(tokens).tolist()
        self._extend_index(key, self._sequences[key])
        self._finished[key] = None
        while len(self._finished) > self.max_cached:
            old, _ = self._finished.popitem(last=False)
            self._sequences.pop(old, None)
            self._indexed.pop(old, None)
        if self._entries > 2 * sum(self._indexed.values()) + 4096:
            self._compact()

    def _extend_index(self, key: object, seq: list[int]) -> None:
        start = max(self._indexed.get(key, 0), 1)
        if start >= len(seq):
            return
        tail = seq[start - 1 :]
        index = self._index
        for offset, pair in enumerate(zip(tail, tail[1:], strict=False)):
            index[pair].append((key, start + offset))  # where the pair's second token is
        self._entries += len(tail) - 1
        self._indexed[key] = len(seq)

    def _draft(self, key: object, seq: list[int], k: int) -> np.ndarray:
        n = len(seq)
        if n < 2 or k <= 0:
            return np.zeros(0, np.int64)
        found = self._index.get((seq[-2], seq[-1]), [])
        matches: list[tuple[int, list[int], int]] = []  # (matched length, sequence, end)
        longest = 0
        for where, end in reversed(found[-MAX_CANDIDATES:]):
            other = self._sequences.get(where)
            if other is None or (where == key and end >= n - 1):
                continue  # a forgotten sequence, or the row's own last tokens
            # The tokens before the pair match back to ``length`` (at most ``most``); quoted
            # text mostly matches all the way, which one slice comparison finds.
            most = min(self.depth, end + 1, n)
            if most > 2 and other[end + 1 - most : end + 1] == seq[n - most :]:
                length = most
            else:
                length = 2
                while length < most and other[end - length] == seq[n - 1 - length]:
                    length += 1
            if length > longest:
                longest, matches = length, []
            if length == longest:
                matches.append((length, other, end))
        if not matches:
            return np.zeros(0, np.int64)
        limit = min(k, max(1, math.floor(self.factor * longest)))
        draft: list[int] = []
        for j in range(1, limit + 1):
            votes: dict[int, int] = {}
            for _, other, end in matches:
                if end + j < len(other):
                    token = other[end + j]
                    votes[token] = votes.get(token, 0) + 1
            if not votes:
                break
            token, count = max(votes.items(), key=lambda kv: kv[1])
            if count / len(matches) < self.min_prob:
                break
            draft.append(token)
            matches = [m for m in matches if m[2] + j < len(m[1]) and m[1][m[2] + j] == token]
        return np.array(draft, np.int64)

    def _compact(self) -> None:
        """Drop index entries of forgotten sequences."""
        live = self._sequences
        self._entries = 0
        for pair in list(self._index):
            kept = [entry for entry in self._index[pair] if entry[0] in live]
            if kept:
                self._index[pair] = kept
                self._entries += len(kept)
            else:
                del self._index[pair]
