"""Suffix decoding: drafts from every earlier occurrence of a row's recent tokens, in its own
prompt and output and in recently finished requests (agent loops repeat across requests,
not only within one).

An index maps each pair of consecutive tokens to where it occurs, in the live rows and in
up to ``max_cached_requests`` finished sequences. To propose, the occurrences of the row's
last two tokens (the ``MAX_CANDIDATES`` most recent) are extended backwards while they
match (up to ``max_tree_depth`` tokens); the longest matches then vote, position by
position, on what follows, as a walk down the suffix tree of those occurrences would: the
most frequent continuation (the most recent occurrence's, on a tie) is drafted while its
share of the surviving matches is at least ``min_token_prob``, and for at most
``max_spec_factor`` tokens per matched token (a longer match earns a longer draft).

A call drafts for all its rows at once, in numpy: every sequence's tokens are kept in one
int32 arena, each after a -1 (a backward match stops there) and followed by -1s (room to
grow; a continuation stops there), so a step's candidates are matched and vote as arrays,
not token by token in Python. Every row's new tokens are indexed before any row drafts. A
forgotten sequence's entries leave the index with it (they are among the oldest of their
lists), its id is reused and its place in the arena packed away once given-up places fill
half of it: no pause to sweep the whole index, however long the engine serves.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from streams.drafting.ngram import NgramDrafter

MAX_CANDIDATES = 64  # occurrences of a pair looked at (the most recent ones)
END = -1  # in the arena: before and after each sequence's tokens
_NO_TOKEN = -2  # neither a token nor END: where a row has no token to match or draft
_OFFSET_BITS = 32  # an index entry: sequence id << 32 | offset of the pair's second token
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1


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
        # Positions below ``depth`` hold END, so a backward read from any sequence stays
        # inside the arena; the arena always ends with END, where forward reads are clipped.
        self._arena = np.full(1 << 12, END, np.int32)  # grows as needed
        self._top = self.depth + 1  # where the next sequence's leading END goes
        self._base = np.full(64, -1, np.int64)  # by sequence id: its first token's position
        self._length: dict[int, int] = {}  # by id, the sequences kept
        self._room: dict[int, int] = {}  # by id, the tokens its place holds
        self._live: dict[int, int] = {}  # row -> its sequence id
        self._finished: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._free: list[int] = []  # ids of forgotten sequences, to reuse
        self._next_id = 0
        self._held_room = 0  # the places of the sequences kept, their leading END included
        self._index: dict[int, list[int]] = {}  # by pair (``_pair_keys``)

    # ------------------------------------------------------------------ the contract
    def propose(self, rows: list[int], tokens: list[np.ndarray], ks: list[int]) -> list[np.ndarray]:
        ids = [self._hold(row, held) for row, held in zip(rows, tokens, strict=True)]
        out = [np.zeros(0, np.int64) for _ in rows]
        drafting = [i for i, k in enumerate(ks) if k > 0 and len(tokens[i]) >= 2]
        if not drafting:
            return out
        found: list[int] = []
        counts = []
        arena, base = self._arena, self._base
        for i in drafting:
            end = int(base[ids[i]]) + len(tokens[i])  # the row's tokens as held
            first, second = arena[end - 2 : end].tolist()
            occurrences = self._index.get(first << _OFFSET_BITS | second, [])
            occurrences = occurrences[-MAX_CANDIDATES:]
            found.extend(reversed(occurrences))
            counts.append(len(occurrences))
        drafts = self._draft(
            np.array([ids[i] for i in drafting], np.int64),
            np.array([len(tokens[i]) for i in drafting], np.int64),
            np.array([ks[i] for i in drafting], np.int64),
            np.array(found, np.int64),
            np.array(counts, np.int64),
        )
        for i, draft in zip(drafting, drafts, strict=True):
            out[i] = draft
        return out

    def release(self, row: int, tokens: np.ndarray) -> None:
        """The row's sequence joins the finished ones (the oldest are forgotten)."""
        live = self._live.pop(row, None)
        if self.max_cached == 0 or len(tokens) < 2:
            self._forget(live)
            return
        seq = self._extend(live, np.asarray(tokens))
        self._finished[seq] = None
        while len(self._finished) > self.max_cached:
            old, _ = self._finished.popitem(last=False)
            self._forget(old)

    # ------------------------------------------------------------------ sequences
    def _hold(self, row: int, tokens: np.ndarray) -> int:
        """The row's sequence id, its tokens now ``tokens``: a live row's tokens only grow
        (tokens that end as the row's held do are taken for them, grown); others (a
        replay's) start the row afresh."""
        seq = self._extend(self._live.get(row), tokens, whole=False)
        self._live[row] = seq
        return seq

    def _extend(self, seq: int | None, tokens: np.ndarray, whole: bool = True) -> int:
        """``seq`` grown to ``tokens`` and indexed, where they start with its tokens (where
        they end as its do, unless ``whole``); else a new sequence of ``tokens`` (``seq``
        forgotten)."""
        held = 0 if seq is None else self._length[seq]
        base = 0 if seq is None else int(self._base[seq])
        grows = (
            held
            and len(tokens) >= held
            and self._arena[base + held - 1] == tokens[held - 1]
            and (not whole or np.array_equal(self._arena[base : base + held], tokens[:held]))
        )
        if not grows:
            self._forget(seq)
            seq, held = self._new_sequence(len(tokens)), 0
        n = len(tokens)
        if n == held:
            return seq
        if n > self._room[seq]:
            self._move(seq, 2 * n)
        base = int(self._base[seq])
        self._arena[base + held : base + n] = tokens[held:]
        self._length[seq] = n
        start = max(held, 1)
        index, first = self._index, (seq << _OFFSET_BITS) + start
        for code, pair in enumerate(_pair_keys(tokens[start - 1 :]), first):
            entries = index.get(pair)
            if entries is None:
                index[pair] = [code]
            else:
                entries.append(code)
        return seq

    def _new_sequence(self, length: int) -> int:
        if self._free:
            seq = self._free.pop()
        else:
            seq, self._next_id = self._next_id, self._next_id + 1
            if seq >= len(self._base):
                grown = np.full(2 * len(self._base), -1, np.int64)
                grown[: len(self._base)] = self._base
                self._base = grown
        room = max(2 * length, 64)
        self._base[seq], self._room[seq], self._length[seq] = self._place(room), room, 0
        self._held_room += 1 + room
        return seq

    def _place(self, room: int) -> int:
        """A place for ``room`` tokens at the arena's top: the position of its first."""
        need = self._top + 1 + room + 1  # its END, its tokens, the arena's last END
        if need > len(self._arena) and self._top > 2 * self._held_room:
            self._pack()  # more than half of it is places given up
            need = self._top + 1 + room + 1
        if need > len(self._arena):
            grown = np.full(max(2 * len(self._arena), need), END, np.int32)
            grown[: self._top] = self._arena[: self._top]
            self._arena = grown
        base = self._top + 1
        self._top = base + room
        return base

    def _pack(self) -> None:
        """The sequences kept moved to the arena's start, in order, with their room."""
        arena = np.full(len(self._arena), END, np.int32)
        top = self.depth + 1
        for seq, room in self._room.items():
            old, n = int(self._base[seq]), self._length[seq]
            arena[top + 1 : top + 1 + n] = self._arena[old : old + n]
            self._base[seq] = top + 1
            top += 1 + room
        self._arena, self._top = arena, top

    def _move(self, seq: int, room: int) -> None:
        n = self._length[seq]
        base = self._place(room)
        old = int(self._base[seq])  # placing may have packed the arena
        self._arena[base : base + n] = self._arena[old : old + n]
        self._arena[old : old + self._room[seq]] = END
        self._held_room += room - self._room[seq]
        self._base[seq], self._room[seq] = base, room

    def _forget(self, seq: int | None) -> None:
        """The sequence and its index entries dropped (its id and place free again)."""
        if seq is None or seq not in self._length:
            return
        base, n, room = int(self._base[seq]), self._length.pop(seq), self._room.pop(seq)
        index = self._index
        # Its entries are among the oldest of their lists, so found near the front.
        for code, pair in enumerate(
            _pair_keys(self._arena[base : base + n]), (seq << _OFFSET_BITS) + 1
        ):
            entries = index[pair]
            entries.remove(code)
            if not entries:
                del index[pair]
        self._arena[base : base + room] = END
        self._base[seq] = -1
        self._held_room -= 1 + room
        self._free.append(seq)

    # ------------------------------------------------------------------ drafting
    def _draft(
        self,
        own: np.ndarray,
        lengths: np.ndarray,
        ks: np.ndarray,
        found: np.ndarray,
        counts: np.ndarray,
    ) -> list[np.ndarray]:
        """Drafts for rows of sequences ``own`` [R] (``lengths`` tokens each, up to ``ks``
        drafts), from ``found``: the candidates' index entries, ``counts[r]`` of row r's
        in a run, the most recent first."""
        arena, depth, rows = self._arena, self.depth, len(own)
        row_of = np.repeat(np.arange(rows), counts)
        seq, end = found >> _OFFSET_BITS, found & _OFFSET_MASK
        # The row's own last two tokens are no candidate (the index holds only kept sequences).
        valid = ~((seq == own[row_of]) & (end >= lengths[row_of] - 1))
        at = np.where(valid, self._base[seq] + end, depth)  # depth: every read stays inside
        back = np.arange(depth)
        own_end = self._base[own] + lengths - 1
        mine = np.where(back < lengths[:, None], arena[own_end[:, None] - back], _NO_TOKEN)
        differs = arena[at[:, None] - back] != mine[row_of]
        matched = np.where(differs.any(axis=1), differs.argmax(axis=1), depth)
        matched = np.where(valid, matched, 0)
        longest = np.zeros(rows, np.int64)
        np.maximum.at(longest, row_of, matched)
        keep = (matched == longest[row_of]) & (matched > 0)
        limits = np.where(
            longest > 0,
            np.minimum(ks, np.maximum(1, np.floor(self.factor * longest).astype(np.int64))),
            0,
        )
        return self._vote(row_of[keep], at[keep], limits)

    def _vote(self, row_of: np.ndarray, at: np.ndarray, limits: np.ndarray) -> list[np.ndarray]:
        """Position by position, each row's matches (at ``at``, of row ``row_of``) vote on
        what follows; the winner is drafted while its share is at least ``min_prob``."""
        arena, last = self._arena, len(self._arena) - 1
        rows = len(limits)
        drafts = np.zeros((rows, int(limits.max(initial=0))), np.int64)
        drafted = np.zeros(rows, np.int64)
        going = limits > 0
        for j in range(1, drafts.shape[1] + 1):
            going &= limits >= j
            voters = going[row_of]
            row_of, at = row_of[voters], at[voters]
            if not len(at):
                break
            token = arena[np.minimum(at + j, last)].astype(np.int64)
            surviving = np.bincount(row_of, minlength=rows)
            present = token != END
            key = (row_of[present] << _OFFSET_BITS) | token[present]
            keys, first, votes = np.unique(key, return_index=True, return_counts=True)
            voted_row = keys >> _OFFSET_BITS
            # per row: the most votes, then the earliest (the most recent occurrence's)
            order = np.lexsort((first, -votes, voted_row))
            leads = np.ones(len(order), bool)  # each row's first in that order
            leads[1:] = voted_row[order][1:] != voted_row[order][:-1]
            winners = order[leads]
            winner_row, winner_votes = voted_row[winners], votes[winners]
            wins = winner_votes / surviving[winner_row] >= self.min_prob
            choice = np.full(rows, _NO_TOKEN, np.int64)
            choice[winner_row[wins]] = keys[winners[wins]] & _OFFSET_MASK
            going &= choice != _NO_TOKEN
            drafts[going, j - 1] = choice[going]
            drafted[going] = j
            alive = token == choice[row_of]
            row_of, at = row_of[alive], at[alive]
        return [drafts[r, : drafted[r]] for r in range(rows)]


def _pair_keys(tokens: np.ndarray) -> list[int]:
    """Each pair of consecutive tokens as one int (first << 32 | second): an int hashes
    faster than a tuple, and numpy makes a long run's at once."""
    if len(tokens) <= 16:
        held = tokens.tolist()
        return [
            first << _OFFSET_BITS | second for first, second in zip(held, held[1:], strict=False)
        ]
    held = tokens.astype(np.int64)
    return ((held[:-1] << _OFFSET_BITS) | held[1:]).tolist()
