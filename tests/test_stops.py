"""The stop-string automaton against a plain search, on random texts fed in random pieces."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from async_engine.core.stops import StopAutomaton

ALPHABET = "abc é"


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The earliest end of any stop string in text; the longest one ending there."""
    best = None
    for stop in stops:
        at = text.find(stop)
        if at != -1:
            key = (at + len(stop), -len(stop))
            if best is None or key < best[0]:
                best = (key, stop)
    return None if best is None else (best[0][0], best[1])


@given(
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=8),
    pieces=st.lists(st.text(ALPHABET, max_size=6), max_size=12),
)
def test_fed_in_pieces_it_finds_what_a_plain_search_finds(stops: list[str], pieces: list[str]):
    automaton, state, seen, found = StopAutomaton(tuple(stops)), 0, "", None
    for piece in pieces:
        state, end, stop = automaton.feed(state, piece)
        if stop is not None:
            found = (len(seen) + end, stop)
            break
        seen += piece
        # Everything but the held-back tail can never be part of a stop string.
        assert all(stop not in seen for stop in stops)
        assert automaton.depth[state] <= max(len(s) for s in stops) - 1
    assert found == first_stop("".join(pieces), stops) or (
        found is None and first_stop("".join(pieces), stops) is None
    )


def test_the_held_back_tail_is_exactly_a_possible_stop_prefix():
    automaton = StopAutomaton(("</answer>",))
    state, _, _ = automaton.feed(0, "the answer is 4</ans")
    assert automaton.depth[state] == len("</ans")
    state, _, _ = automaton.feed(state, "wer, or not")
    assert automaton.depth[state] == 0
