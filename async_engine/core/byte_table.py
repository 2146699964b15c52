"""Token ids to text through a table of each token's bytes, for byte-level BPE tokenizers.

The fast tokenizers' decode costs about 27 us for 133 tokens on a Xeon core (each id goes
through the vocabulary, the added tokens and the byte-level decoder). Streaming decodes a
window per step per request, and an offline batch of 1,024 decodes its outputs at the end:
at a 1 ms step that time is taken from the steps. A byte-level BPE token is a fixed byte
string, so its text is a lookup and one UTF-8 decode: a few microseconds.

The table is built from the tokenizer's own description and then checked against its
decode on every token and on random sequences; any difference and it is not used.
"""

from __future__ import annotations

import random
from typing import Any

SAMPLES = 400  # random sequences checked against the tokenizer's decode, besides
RUN = 12  # every token once, in runs of this many


def _unicode_to_byte() -> dict[str, int]:
    """Byte-level BPE spells byte b as a printable character; this undoes it."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class ByteTable:
    """Each token's bytes; ``decode`` joins them and decodes UTF-8 as the tokenizer does
    (an incomplete or invalid sequence becomes U+FFFD)."""

    def __init__(self, token_bytes: list[bytes], special: frozenset[int]) -> None:
        self.token_bytes = token_bytes
        self.skipped = [b"" if i in special else b for i, b in enumerate(token_bytes)]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        table = self.skipped if skip_special_tokens else self.token_bytes
        try:
            data = b"".join(map(table.__getitem__, token_ids))
        except IndexError:  # an id past the vocabulary (a padded embedding's): it spells nothing
            n = len(table)
            data = b"".join(table[i] for i in token_ids if 0 <= i < n)
        return data.decode("utf-8", "replace")

    @classmethod
    def of(cls, hf: Any) -> ByteTable | None:
        """The table of a byte-level BPE fast tokenizer whose decode it reproduces, else None."""
        backend = getattr(hf, "_tokenizer", None)
        if backend is None or getattr(hf, "clean_up_tokenization_spaces", False):
            return None
        kinds = (type(backend.decoder).__name__, type(backend.model).__name__)
        if kinds != ("ByteLevel", "BPE"):
            return None
        try:
            table = _build(
                backend.get_vocab(with_added_tokens=False),
                backend.get_added_tokens_decoder(),
                backend.get_vocab_size(with_added_tokens=True),
            )
        except (UnicodeEncodeError, IndexError, TypeError, AttributeError):
            return None  # a token that is not a byte-level spelling, or an unknown shape
        return table if _agrees(table, backend) else None


def _build(vocab: dict[str, int], added: dict[int, Any], size: int) -> ByteTable:
    # Each character to the byte it spells, as a code point below 256, so that one
    # translate and a latin-1 encode give a token's bytes (a stray character fails the
    # encode or, if below 256, the check against the tokenizer's own decode).
    spelled = str.maketrans({c: chr(b) for c, b in _unicode_to_byte().items()})
    token_bytes = [b""] * size
    for token, i in vocab.items():
        token_bytes[i] = token.translate(spelled).encode("latin-1")
    for i, token in added.items():
        token_bytes[i] = token.content.encode()
    special = frozenset(i for i, token in added.items() if token.special)
    return ByteTable(token_bytes, special)


def _agrees(table: ByteTable, backend: Any) -> bool:
    """Every token, in short runs of random neighbours (which also makes broken UTF-8),
    decodes as the tokenizer decodes it, special tokens kept or skipped."""
    ids = list(range(len(table.token_bytes)))
    rng = random.Random(0)
    rng.shuffle(ids)
    runs = [ids[i : i + RUN] for i in range(0, len(ids), RUN)]
    runs += [[rng.choice(ids) for _ in range(rng.randrange(1, 3 * RUN))] for _ in range(SAMPLES)]
    for skip in (True, False):
        expected = backend.decode_batch(runs, skip_special_tokens=skip)
        if [table.decode(run, skip) for run in runs] != expected:
            return False
    return True
