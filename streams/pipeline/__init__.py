"""The pipelined device runner: streams, events, pinned slots and tokens kept on the device.

``devsync`` is the stream/event/pinned-memory shim (CUDA, or a serialised host twin), ``clock``
maps device events onto the host clock, ``slots`` holds the pinned buffers a step's arrays
travel in, ``device_rows`` the rows' state on the device, ``forward`` runs a step's forward
(through ``graphs``, the padded decode buckets, where it fits one), ``memory`` sizes the KV
pool, and ``runner`` launches steps without waiting for them and finishes them in launch order.
"""
