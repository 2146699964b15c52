"""The host twin with stream order checked: on the host every stream runs in program order,
so a write on one stream and a read on another that nothing orders still give the right
tokens here, and race on a GPU. ``OrderedSync`` stamps every tensor access with the stream
it was issued on and a vector clock, and raises ``StreamRace`` for an access that is not
ordered after the last conflicting one on another stream.

What orders stream B after work on stream A, as on CUDA: B waits on an event recorded on A
after that work (``wait_event``), B waits on A (``wait_stream``), or the host waited for the
work (an event's or a stream's ``synchronize``, a true ``query``, a device ``synchronize``)
before it issued B's. Conflicts: a read after a write, a write after a read or a write, on
different streams; a host read of what a stream wrote (a device-to-host copy) before the host
waited for it; and a device tensor freed while another stream's work on it may be queued
(the caching allocator gives its memory back to the stream it was allocated on at once).

Which tensors are the device's: those made with an explicit ``torch.device`` (``device=``,
``.to(device)``) and what ops on them make; the rest (host mirrors, pinned staging,
``from_numpy``) are the host's, as on a GPU host, where an op on host tensors alone runs on
the host when issued. A tensor from ``empty`` is allocated, not written. Accesses are seen
through torch's dispatch: torch ops only, not memory touched through numpy or a C kernel's
pointer (tests run the torch attention path).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from streams.pipeline.devsync import DeviceSync, HostEvent, HostStream

Clock = dict[int, int]  # stream id -> the last of its operations known to be ordered before
# Ops that allocate without writing, and in-place ops that change only a tensor's metadata.
_ALLOCATE = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
_METADATA = {"detach_", "squeeze_", "unsqueeze_", "transpose_", "t_", "as_strided_"}


class StreamRace(RuntimeError):
    """Two accesses to one tensor with nothing ordering them."""


def _join(into: Clock, other: Clock) -> None:
    for stream, time in other.items():
        if into.get(stream, 0) < time:
            into[stream] = time


class OrderedStream(HostStream):
    def __init__(self, sync: OrderedSync, name: str) -> None:
        self.sync, self.name = sync, name
        self.id = len(sync.streams)
        self.clock: Clock = {self.id: 0}
        sync.streams.append(self)

    def wait_event(self, event: OrderedEvent) -> None:
        super().wait_event(event)
        _join(self.clock, event.clock)

    def wait_stream(self, stream: OrderedStream) -> None:
        _join(self.clock, stream.clock)

    def synchronize(self) -> None:
        _join(self.sync.host, self.clock)

    def tick(self) -> int:
        """An operation issued now: after all the host knows is done."""
        _join(self.clock, self.sync.host)
        self.clock[self.id] += 1
        return self.clock[self.id]

    def ordered_after(self, stream: int, time: int) -> bool:
        return stream == self.id or self.clock.get(stream, 0) >= time


class OrderedEvent(HostEvent):
    __slots__ = ("clock", "sync")

    def __init__(self, sync: OrderedSync) -> None:
        super().__init__()
        self.sync, self.clock = sync, {}

    def record(self, stream: OrderedStream | None = None) -> None:
        super().record(stream)
        self.clock = dict((stream or self.sync.current()).clock)

    def query(self) -> bool:
        done = super().query()
        if done:
            _join(self.sync.host, self.clock)
        return done

    def synchronize(self) -> None:
        super().synchronize()
        _join(self.sync.host, self.clock)


@dataclass(slots=True)
class _Accesses:
    """One tensor storage's stream accesses that later ones must be ordered after."""

    on_device: bool
    allocated_on: int | None = None  # the stream whose pool it came from (device tensors)
    writer: tuple[int, int] | None = None  # (stream, time) of the last stream write
    writer_op: str = ""
    readers: dict[int, int] = field(default_factory=dict)  # stream -> time, since that write


class OrderedSync(DeviceSync):
    """``DeviceSync``'s host twin with every stream access ordered or raising. Use inside
    ``watch()``; a race found as a tensor is freed raises at the next operation."""

    # The runner then takes the GPU's paths (a step's tokens are waited for when finished,
    # not at launch), so the host knows no more than it would there.
    serial = False

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(torch.device(device))
        self.streams: list[OrderedStream] = []
        self.host: Clock = {}
        self.default = OrderedStream(self, "default")
        self._current = threading.local()
        self._storages: dict[int, _Accesses] = {}
        self._found: list[str] = []
        self._raised = 0  # of _found
        self.placing = False  # inside a call that puts its result on the device

    def stream(self) -> OrderedStream:
        return OrderedStream(self, f"stream {len(self.streams)}")

    def event(self, timing: bool = False, blocking: bool = False) -> OrderedEvent:
        return OrderedEvent(self)

    def current(self) -> OrderedStream:
        return getattr(self._current, "stream", None) or self.default

    @contextmanager
    def use(self, stream: OrderedStream) -> Iterator[None]:
        before = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            yield
        finally:
            self._current.stream = before

    def synchronize(self) -> None:
        for stream in self.streams:
            _join(self.host, stream.clock)

    @contextmanager
    def watch(self) -> Iterator[None]:
        """Check every torch operation issued inside. A race raises where it is found and
        again on leaving, whatever caught it in between (a runner turns a failed step into
        its result)."""
        self._found, self._raised = [], 0
        try:
            with _Placement(self), _Watch(self):
                yield
        finally:
            if self._found:
                raise StreamRace("; ".join(dict.fromkeys(self._found)))

    def _raise_new(self) -> None:
        if len(self._found) > self._raised:
            new, self._raised = self._found[self._raised :], len(self._found)
            raise StreamRace("; ".join(new))

    # ------------------------------------------------------------------ accesses
    def operation(self, op: str, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> bool:
        """Check and stamp an operation's accesses; whether it runs on a stream (it touches
        a device tensor, or makes one) rather than on the host."""
        self._raise_new()
        touched = [self._accesses(t) for t in reads + writes]
        on_stream = any(a.on_device for a in touched) or (not touched and self.placing)
        if on_stream:
            self._on_stream(op, reads, writes)
        else:
            self._on_host(op, reads, writes)
        self._raise_new()
        return on_stream

    def made(self, op: str, tensor: torch.Tensor, on_stream: bool) -> None:
        """A tensor an operation made: the device's, from the current stream's pool, when
        the operation ran on a stream (written unless ``empty``)."""
        accesses = self._accesses(tensor)
        if not on_stream:
            return
        stream = self.current()
        accesses.on_device, accesses.allocated_on = True, stream.id
        if op not in _ALLOCATE:
            accesses.writer, accesses.writer_op = (stream.id, stream.clock[stream.id]), op

    def placed(self, tensor: torch.Tensor) -> None:
        """``tensor.to(device)``: the device's from now on (on a CPU it may be the same
        storage as the host tensor it came from)."""
        self._accesses(tensor).on_device = True

    def _on_stream(self, op: str, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> None:
        stream = self.current()
        time = stream.tick()
        for tensor in reads:
            accesses = self._accesses(tensor)
            if accesses.writer is not None and not stream.ordered_after(*accesses.writer):
                self._race(f"{op} on {stream.name} reads a tensor", accesses)
            accesses.readers[stream.id] = time
        for tensor in writes:
            accesses = self._accesses(tensor)
            if accesses.writer is not None and not stream.ordered_after(*accesses.writer):
                self._race(f"{op} on {stream.name} writes a tensor", accesses)
            for reader, at in accesses.readers.items():
                if not stream.ordered_after(reader, at):
                    self._found.append(
                        f"{op} on {stream.name} writes a tensor read on "
                        f"{self.streams[reader].name} (operation {at}) with nothing ordering "
                        "the two"
                    )
            accesses.writer, accesses.writer_op, accesses.readers = (stream.id, time), op, {}

    def _on_host(self, op: str, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> None:
        """Host work runs when issued, so later stream work follows it; it must itself
        follow the stream work on what it touches (a copy to the host it reads)."""
        for tensor in reads:
            accesses = self._accesses(tensor)
            if (
                accesses.writer is not None
                and self.host.get(accesses.writer[0], 0) < (accesses.writer[1])
            ):
                self._race(f"{op} on the host reads a tensor, before waiting for it,", accesses)
        for tensor in writes:
            accesses = self._accesses(tensor)
            uses = dict(accesses.readers)
            if accesses.writer is not None:
                uses[accesses.writer[0]] = max(accesses.writer[1], uses.get(accesses.writer[0], 0))
            for stream, at in uses.items():
                if self.host.get(stream, 0) < at:
                    self._found.append(
                        f"{op} on the host writes a tensor that {self.streams[stream].name} "
                        f"may still use (operation {at})"
                    )
            accesses.writer, accesses.readers = None, {}

    def _accesses(self, tensor: torch.Tensor) -> _Accesses:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        accesses = self._storages.get(key)
        if accesses is None:
            accesses = self._storages[key] = _Accesses(on_device=False)
            weakref.finalize(storage, self._freed, key, accesses)
        return accesses

    def _freed(self, key: int, accesses: _Accesses) -> None:
        """The memory goes back to its stream's pool now: every other stream's work on it must
        be ordered before that stream's next work, or known done by the host."""
        if self._storages.get(key) is accesses:
            del self._storages[key]
        if accesses.allocated_on is None:
            return
        owner = self.streams[accesses.allocated_on]
        uses = dict(accesses.readers)
        if accesses.writer is not None:
            uses[accesses.writer[0]] = max(uses.get(accesses.writer[0], 0), accesses.writer[1])
        for stream, at in uses.items():
            if not owner.ordered_after(stream, at) and self.host.get(stream, 0) < at:
                self._found.append(
                    f"a tensor of {owner.name}'s pool freed while {self.streams[stream].name}'s "
                    f"work on it (operation {at}) may be queued"
                )

    def _race(self, what: str, accesses: _Accesses) -> None:
        stream, at = accesses.writer  # type: ignore[misc]
        self._found.append(
            f"{what} written on {self.streams[stream].name} (operation {at}, "
            f"{accesses.writer_op}) with nothing ordering the two"
        )


class _Watch(TorchDispatchMode):
    """Every aten operation's reads and writes (from its schema) to the check."""

    def __init__(self, sync: OrderedSync) -> None:
        super().__init__()
        self.sync = sync

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        schema = func._schema
        name = func.__name__.split(".")[0]  # aten.copy_.default -> copy_
        written = {
            a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
        }
        views = all(r.alias_info is not None for r in schema.returns) and not written
        reads, writes = [], []
        bound = dict(zip((a.name for a in schema.arguments), args, strict=False)) | kwargs
        for arg_name, value in bound.items():
            tensors = [t for t in tree_flatten(value)[0] if _real(t)]
            if arg_name in written and name not in _METADATA:
                writes += tensors
            if not views:  # a view reads nothing: what it is read by later counts
                reads += tensors
        on_stream = self.sync.operation(name, reads, writes)
        out = func(*args, **kwargs)
        values = out if isinstance(out, tuple | list) else (out,)
        for value, returned in zip(values, schema.returns, strict=False):
            if returned.alias_info is None and _real(value):
                self.sync.made(name, value, on_stream)
        return out


class _Placement(TorchFunctionMode):
    """Which calls put their result on the device: an explicit ``torch.device`` argument."""

    def __init__(self, sync: OrderedSync) -> None:
        super().__init__()
        self.sync = sync

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        places = any(isinstance(a, torch.device) for a in (*args, *kwargs.values()))
        if not places:
            return func(*args, **kwargs)
        before, self.sync.placing = self.sync.placing, True
        try:
            out = func(*args, **kwargs)
        finally:
            self.sync.placing = before
        for value in out if isinstance(out, tuple | list) else (out,):
            if _real(value):
                self.sync.placed(value)
        return out


def _real(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > 0
