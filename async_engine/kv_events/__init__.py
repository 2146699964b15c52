"""KV events in vLLM's format, so that prefix-aware routers can route on our prefix cache.

The block pool (``blockalloc``) reports blocks joining its prefix cache, evicted blocks and
resets; ``EventBatcher`` (``batcher.py``) gathers a step's reports into one batch of vLLM's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (``events.py``) and
``ZmqPublisher`` (``publisher.py``) sends it, numbered, and keeps it for replay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from async_engine.core.config import EngineConfig
    from async_engine.kv_events.batcher import EventBatcher
    from async_engine.kv_events.publisher import ZmqPublisher
    from blockalloc import BlockPool


class KVEvents:
    """One pool's events being published; ``close`` detaches them and sends what is left."""

    def __init__(self, pool: BlockPool, batcher: EventBatcher, publisher: ZmqPublisher) -> None:
        self._pool = pool
        self._batcher = batcher
        self.publisher = publisher

    @property
    def endpoint(self) -> str | None:
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint

    def sources(self) -> dict[str, Any] | None:
        """The ``/kv_event_sources`` body: rank "0"'s publisher, as vLLM's ``KVEventsConfig``
        names it. A bound wildcard (``tcp://0.0.0.0:5557``) is left for the subscriber to
        replace by the host it reached this server on. None where nobody can subscribe: the
        publisher connects out to an indexer that binds."""
        publisher = self.publisher
        if not publisher.bound:
            return None
        return {
            "0": {
                "endpoint": publisher.endpoint,
                "replay_endpoint": publisher.replay_endpoint,
                "topic": publisher.topic,
                "publisher": "zmq",
                "enable_kv_cache_events": True,
            }
        }

    def close(self) -> None:
        self._pool.events = None
        self._batcher.flush()
        self.publisher.close()


class NoKVEvents:
    """Events off: nothing opened, nothing to close."""

    endpoint: str | None = None
    replay_endpoint: str | None = None

    def sources(self) -> None:
        return None

    def close(self) -> None:
        pass


NO_KV_EVENTS = NoKVEvents()


def attach_kv_events(config: EngineConfig, pool: BlockPool) -> KVEvents | NoKVEvents:
    """Publish ``pool``'s prefix-cache changes where ``config.kv_events_endpoint`` says; with
    no endpoint the pool is left without a listener (one None check per change)."""
    if not config.kv_events_endpoint:
        return NO_KV_EVENTS
    # Imported here: an engine without events never loads ZeroMQ.
    from async_engine.kv_events.batcher import EventBatcher
    from async_engine.kv_events.publisher import ZmqPublisher

    publisher = ZmqPublisher(
        config.kv_events_endpoint, config.kv_events_replay_endpoint, config.kv_events_topic
    )
    batcher = EventBatcher(publisher.publish, pool.block_size, config.kv_events_encoding)
    pool.events = batcher
    return KVEvents(pool, batcher, publisher)
