"""Triton kernels for the CUDA device.

Nothing here imports triton at import time: the CPU engine imports this package, and triton
(present or not) must cost it nothing. The kernels live in ``paged_attention_kernels`` and
are launched through ``paged_attention`` (both imported only by the CUDA path and tests);
``aot`` compiles them ahead of time for an H200 without a GPU.
``available()`` says whether the Triton path can run and, when not, logs one line saying why,
so the caller keeps the torch path.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys

import torch

log = logging.getLogger("async_engine.model")


def unavailable_reason() -> str | None:
    """Why the Triton attention path cannot run here, or None when it can."""
    # find_spec first: a CPU host never pays for importing triton.
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken install must not take the engine down
        return f"triton does not import: {exc!r}"
    kernels = sys.modules.get(f"{__name__}.paged_attention")
    if kernels is not None and kernels.INTERPRETED:
        # Decorated under TRITON_INTERPRET=1 (a test's import): every launch would copy the
        # tensors to the host, which a CUDA step (graph capture, no host syncs) cannot take.
        return "the kernels were imported under Triton's interpreter (TRITON_INTERPRET=1)"
    return None


@functools.cache
def available() -> bool:
    """Whether the Triton kernels run here; the first call logs one line when they do not."""
    reason = unavailable_reason()
    if reason is not None:
        log.info("Triton attention unavailable, using the torch path: %s", reason)
    return reason is None
