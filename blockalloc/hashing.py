"""Stable hash chain over the full blocks of a token sequence."""

import hashlib
import struct
from collections.abc import Sequence

_U64_MAX = 2**64 - 1


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Return one 64-bit hash per FULL block of `token_ids`; a partial last block gets none.

    h_i = blake2b(h_{i-1}, tokens of block i), with h_{-1} = `parent`. Chaining makes a
    block's hash name its whole prefix, so equal hashes mean equal KV content. `parent` also
    serves as a salt (e.g. a model or adapter id) to keep unrelated caches apart.
    blake2b rather than hash(): hash() is salted per process for str/bytes and unspecified
    across Python versions, while these digests must match across processes and restarts.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if parent is not None and not 0 <= parent <= _U64_MAX:
        raise ValueError(f"parent must be an unsigned 64-bit int, got {parent}")
    full = len(token_ids) // block_size
    try:  # all blocks' bytes in one conversion: per block, only a slice and a digest remain
        data = struct.pack(f"<{full * block_size}q", *token_ids[: full * block_size])
    except struct.error as e:
        raise ValueError(f"token ids must be 64-bit signed ints: {e}") from None
    hashes: list[int] = []
    # A flag byte keeps "no parent" distinct from a parent whose value happens to be 0.
    prev = b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "little")
    width = 8 * block_size
    for start in range(0, full * width, width):
        digest = hashlib.blake2b(prev + data[start : start + width], digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little"))
        prev = b"\x01" + digest
    return hashes
