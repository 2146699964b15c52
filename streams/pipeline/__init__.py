"""The pipelined device runner: streams, events, pinned slots and tokens kept on the device.

``devsync`` is the stream/event/pinned-memory shim (CUDA, or a serialised host twin), ``clock``
maps device events onto the host clock, ``graphs`` holds the padded decode buckets, and
``runner`` launches steps without waiting for them and finishes them in launch order.
"""
