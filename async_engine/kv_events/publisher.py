"""KV event batches out over ZeroMQ, framed as vLLM's ``ZmqEventPublisher`` frames them.

Each batch is one PUB message of three frames: the topic, an 8-byte big-endian sequence
number (0, 1, 2, ... per batch) and the msgpack payload. The last ``buffer_batches``
batches are kept, so a subscriber that sees a gap in the sequence can ask the replay
socket (ROUTER) for everything from a sequence number: it sends ``[b"", start]`` (a REQ
socket adds the empty frame itself; a DEALER sends it) and gets ``[b"", seq, payload]``
per kept batch from ``start`` on, then ``[b"", -1 as 8 signed bytes, b""]``.

``publish`` runs on the engine's event loop and never waits: a PUB socket hands the
message to ZeroMQ's I/O thread and drops it for a subscriber whose queue is full. The
replay socket has its own thread, which blocks in ``poll`` and so costs the loop nothing.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque

import zmq

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
POLL_MS = 100  # how often the replay thread looks at its stop flag


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard (``*``, ``::``), ipc or inproc address, connect to any
    other (llm-d's indexer binds, so its engines connect)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def open_socket(sock: zmq.Socket, endpoint: str) -> str:
    """Bind or connect ``endpoint`` as ``binds`` says; the address in use."""
    if binds(endpoint):
        sock.bind(endpoint)
        return sock.last_endpoint.decode()
    sock.connect(endpoint)
    return endpoint


class ZmqPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_batches: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self._ctx = zmq.Context()
        self._lock = threading.Lock()  # publish (loop) vs replay (thread) vs close (any)
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self.topic = topic
        self._topic = topic.encode()
        self._seq = 0
        self._closed = False
        self.dropped = 0  # batches ZeroMQ refused outright (not a slow subscriber's drops)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.replay_endpoint: str | None = None
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.linger = 500  # ms: batches queued at close still get out
        address = endpoint
        self.bound = binds(endpoint)  # subscribers connect here (else it connects out)
        try:
            self.endpoint = open_socket(self._pub, endpoint)
            if replay_endpoint:
                address = replay_endpoint
                self._start_replay(replay_endpoint)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise OSError(f"KV events: cannot open {address}: {e}") from None

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry."""
        return self._seq

    def publish(self, payload: bytes) -> None:
        """Send one encoded batch under the next sequence number and keep it for replay."""
        with self._lock:
            if self._closed:
                return
            seq = self._seq
            self._seq += 1
            self._ring.append((seq, payload))
            try:
                self._pub.send_multipart(
                    (self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK
                )
            except zmq.ZMQError:
                self.dropped += 1  # the gap in sequence numbers tells subscribers

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pub.close()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * POLL_MS / 1000)
            if self._thread.is_alive():
                return  # term() would wait for its socket forever; the daemon thread dies with us
        self._ctx.term()  # waits out the PUB socket's linger

    def _start_replay(self, endpoint: str) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        router.linger = 0
        try:
            router.bind(endpoint)
        except zmq.ZMQError:
            router.close()
            raise
        self.replay_endpoint = router.last_endpoint.decode()
        self._thread = threading.Thread(
            target=self._serve_replay, args=(router,), name="kv-events-replay", daemon=True
        )
        self._thread.start()

    def _serve_replay(self, router: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(POLL_MS):
                    self._answer(router, router.recv_multipart())
        finally:
            router.close()

    def _answer(self, router: zmq.Socket, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not [identity, b"", start]: nothing sensible to answer
        client, _, start = frames
        first = int.from_bytes(start, "big")
        with self._lock:  # copy out, so that publishing never waits on a replay's sends
            skip = max(0, first - self._ring[0][0]) if self._ring else 0
            kept = list(itertools.islice(self._ring, skip, None))
        for seq, payload in kept:
            router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        router.send_multipart((client, b"", END_OF_REPLAY, b""))
