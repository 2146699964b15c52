"""Stop strings matched by one automaton (Aho-Corasick), fed text as it is generated.

Each request's stop strings compile once (cached by the list) into a trie with failure
links. Feeding a character costs amortized O(1) whatever the number of stop strings, and
the state's depth is exactly how much trailing text might still become a stop string:
the text before it can be streamed at once.
"""

from __future__ import annotations

import functools


class StopAutomaton:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self._next: list[dict[str, int]] = [{}]
        self.depth = [0]
        self._fail = [0]
        self._found: list[str | None] = [None]  # the longest stop string ending here
        for stop in stops:
            self._add(stop)
        self._link()

    def _add(self, stop: str) -> None:
        state = 0
        for ch in stop:
            nxt = self._next[state].get(ch)
            if nxt is None:
                nxt = len(self._next)
                self._next[state][ch] = nxt
                self._next.append({})
                self.depth.append(self.depth[state] + 1)
                self._fail.append(0)
                self._found.append(None)
            state = nxt
        if stop:
            self._found[state] = stop

    def _link(self) -> None:
        """Failure links in breadth-first order; a state also reports what its fallback
        reports (a shorter stop string that ends at the same character)."""
        queue = list(self._next[0].values())
        for state in queue:
            for ch, child in self._next[state].items():
                fallback = self._fail[state]
                while fallback and ch not in self._next[fallback]:
                    fallback = self._fail[fallback]
                target = self._next[fallback].get(ch, 0)
                self._fail[child] = target if target != child else 0
                if self._found[child] is None:
                    self._found[child] = self._found[self._fail[child]]
                queue.append(child)

    def feed(self, state: int, text: str) -> tuple[int, int, str | None]:
        """Advance over ``text`` from ``state``: ``(state, end, stop)`` where ``end`` is the
        index in ``text`` just past the first stop string completed (with the stop), or
        ``(state, -1, None)`` when none completed."""
        nxt, fail, found = self._next, self._fail, self._found
        for i, ch in enumerate(text):
            while state and ch not in nxt[state]:
                state = fail[state]
            state = nxt[state].get(ch, 0)
            if found[state] is not None:
                return state, i + 1, found[state]
        return state, -1, None


@functools.lru_cache(maxsize=256)
def stop_automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """Requests with the same stop list share one automaton (agent backends send many)."""
    return StopAutomaton(stops)
