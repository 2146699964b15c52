"""The simulated device's text when it repeats itself, as agent traffic does (tool calls
re-quote JSON, code and earlier turns, whose text the prompt carries): so that
speculation's acceptance at GPU speed is measured from the real drafters, not assumed.

The output quotes spans of the request's own tokens (its prompt, which holds the earlier
turns of its session, and its output so far). Which positions quote, and from where, is a
hash of the request's seed and the position alone, never of the tokens: at each position a
quote goes on (the token after the one it copied last) with probability ``CONTINUE``, and
one starts with the probability that makes ``repeat`` the share of quoted tokens, at a
position drawn from everything before. A quoted token is the token there; the others are
``sim_tokens``'s. So the text is a pure function of the request's tokens, as ``sim_tokens``
is, and a verified draft is right exactly when one-at-a-time decoding gives it.
"""

from __future__ import annotations

import numpy as np

from streams.sim import sim_tokens

CONTINUE = 0.9  # a quote goes on: spans of about ten tokens
NOT_QUOTING = -1


def _uniform(seed: int, position: int, salt: int) -> float:
    """A uniform draw in [0, 1) from (seed, position, salt), splitmix64-style."""
    x = (seed * 0xD6E8FEB86659FD93 + position * 0x9E3779B97F4A7C15 + salt) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return ((x ^ (x >> 31)) >> 11) * 2.0**-53


class RepeatingText:
    def __init__(self, repeat: float, vocab_size: int, avoid: np.ndarray) -> None:
        self.repeat = repeat
        self.vocab_size = vocab_size
        self.avoid = avoid
        # Quotes start so that, with CONTINUE, the stationary share quoted is ``repeat``.
        self.start = min(1.0, repeat * (1 - CONTINUE) / max(1e-9, 1 - repeat))
        self._sources: dict[int, tuple[int, list[int]]] = {}  # row -> (first position, src)

    def tokens(
        self,
        rows: np.ndarray,
        histories: list[np.ndarray],
        drafts: list[list[int]],
        seeds: np.ndarray,
    ) -> np.ndarray:
        """The token after each context: row ``rows[i]``'s tokens ``histories[i]`` followed
        by ``drafts[i]`` (a verified position's drafts before it)."""
        last = np.array([d[-1] if d else h[-1] for h, d in zip(histories, drafts, strict=True)])
        positions = np.array([len(h) - 1 + len(d) for h, d in zip(histories, drafts, strict=True)])
        out = sim_tokens(last, positions, seeds, self.vocab_size, self.avoid)
        for i, (row, position) in enumerate(zip(rows.tolist(), positions.tolist(), strict=True)):
            src = self._source(row, int(seeds[i]), position, len(histories[i]))
            if src != NOT_QUOTING:
                history = histories[i]
                out[i] = history[src] if src < len(history) else drafts[i][src - len(history)]
        return out

    def finished(self, row: int) -> None:
        self._sources.pop(row, None)

    def _source(self, row: int, seed: int, position: int, held: int) -> int:
        """Where the token after ``position`` is quoted from (or NOT_QUOTING); a row's first
        sampled position (``held`` - 1, its prompt's last) starts its record."""
        first, sources = self._sources.get(row, (None, None))
        if first is None or position < first:
            first, sources = held - 1, []
            self._sources[row] = (first, sources)
        while first + len(sources) <= position:
            at = first + len(sources)
            before = sources[-1] if sources else NOT_QUOTING
            if before != NOT_QUOTING and _uniform(seed, at, 1) < CONTINUE:
                sources.append(before + 1)
            elif _uniform(seed, at, 2) < self.start:
                sources.append(int(_uniform(seed, at, 3) * (at + 1)))
            else:
                sources.append(NOT_QUOTING)
        return sources[position - first]
