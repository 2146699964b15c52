"""The pool's listener: a step's prefix-cache changes gathered into one event batch.

A step's registrations and evictions happen in one synchronous stretch of the event loop,
so the first event of a stretch schedules a flush with ``call_soon``: the batch goes out
once the stretch ends, one message per step rather than one per block. Without a running
loop (a script driving a pool by hand) every event is flushed at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import msgpack

from async_engine.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    encode_batch,
)


class EventBatcher:
    """Implements blockalloc's ``CacheEvents``; ``send`` gets each encoded batch."""

    def __init__(self, send: Callable[[bytes], None], block_size: int, encoding: str) -> None:
        self._send = send
        self._block_size = block_size
        self._encoding = encoding
        self._pending: list[Event] = []
        self._scheduled = False

    def stored(self, hashes: list[int], parent: int | None, token_ids: Sequence[int]) -> None:
        self._add(BlockStored(hashes, parent, list(token_ids), self._block_size))

    def removed(self, hashes: list[int]) -> None:
        last = self._pending[-1] if self._pending else None
        if type(last) is BlockRemoved:  # evictions come one block at a time: merge them
            last.block_hashes.extend(hashes)
            return
        self._add(BlockRemoved(list(hashes)))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    def flush(self) -> None:
        """Send what is pending as one batch (nothing when nothing is)."""
        self._scheduled = False
        if not self._pending:
            return
        events, self._pending = self._pending, []
        batch = encode_batch(time.time(), events, self._encoding)
        # default=int: a numpy integer among the token ids packs as the int it is.
        self._send(msgpack.packb(batch, default=int))

    def _add(self, event: Event) -> None:
        self._pending.append(event)
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._scheduled = True
        loop.call_soon(self.flush)
