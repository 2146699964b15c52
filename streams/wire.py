"""Plans and results as one flat byte frame: a fixed header, then the arrays back to back.

Pickling a plan of numpy arrays costs ~20 us and a plan of nested lists far more; this
frame costs ~7 us both ways for a 256-request step. Rare parts (new rows with their
sampling settings, logprobs, an error) ride along pickled, only when present. Every
message between the control plane and the device process starts with a byte naming its kind.
"""

from __future__ import annotations

import pickle
import struct

import numpy as np

from streams.plan import StepPlan, StepResult

# The kind bytes, sent and read by ``streams.process_device`` and ``streams.device_loop``.
STEP, REPLAY, SHUTDOWN, RESULT, READY, FAILED = b"S", b"R", b"Q", b"r", b"+", b"!"

_PLAN_HEAD = struct.Struct("<q9i")  # step id; lengths of the 8 arrays; pickled extras length
_PLAN_ARRAYS = (
    ("rows", np.int32),
    ("starts", np.int32),
    ("query_lens", np.int32),
    ("num_sampled", np.int32),
    ("input_ids", np.int64),
    ("released_rows", np.int32),
    ("reset_rows", np.int32),
    ("new_blocks", np.int32),
)
# step id, start, end; lengths of tokens, counts, drafted; pickled extras length
_RESULT_HEAD = struct.Struct("<qddiiii")


def encode_plan(plan: StepPlan) -> bytes:
    arrays = [np.ascontiguousarray(getattr(plan, name), dtype) for name, dtype in _PLAN_ARRAYS]
    extra = pickle.dumps(plan.new_rows, 5) if plan.new_rows else b""
    head = _PLAN_HEAD.pack(plan.step_id, *(len(a) for a in arrays), len(extra))
    return b"".join([head, *(a.tobytes() for a in arrays), extra])


def decode_plan(frame: bytes) -> StepPlan:
    step_id, *lengths, extra_len = _PLAN_HEAD.unpack_from(frame)
    offset = _PLAN_HEAD.size
    values = {}
    for (name, dtype), n in zip(_PLAN_ARRAYS, lengths, strict=True):
        values[name] = np.frombuffer(frame, dtype, n, offset)
        offset += n * np.dtype(dtype).itemsize
    new_rows = pickle.loads(frame[offset : offset + extra_len]) if extra_len else []
    return StepPlan(step_id=step_id, new_rows=new_rows, **values)


def encode_result(result: StepResult) -> bytes:
    tokens = np.ascontiguousarray(result.tokens, np.int64)
    counts = np.ascontiguousarray(result.counts, np.int32)
    drafted = np.ascontiguousarray(result.drafted, np.int32)
    rare = (result.logprobs, result.top_logprobs, result.error, result.prompt_logprobs)
    extra = pickle.dumps(rare, 5) if any(x is not None for x in rare) else b""
    head = _RESULT_HEAD.pack(
        result.step_id,
        result.device_start,
        result.device_end,
        len(tokens),
        len(counts),
        len(drafted),
        len(extra),
    )
    return b"".join((head, tokens.tobytes(), counts.tobytes(), drafted.tobytes(), extra))


def decode_result(frame: bytes) -> StepResult:
    step_id, start, end, n, n_counts, n_drafted, extra_len = _RESULT_HEAD.unpack_from(frame)
    offset = _RESULT_HEAD.size
    tokens = np.frombuffer(frame, np.int64, n, offset)
    offset += 8 * n
    counts = np.frombuffer(frame, np.int32, n_counts, offset)
    offset += 4 * n_counts
    drafted = np.frombuffer(frame, np.int32, n_drafted, offset)
    offset += 4 * n_drafted
    logprobs = top = error = prompt = None
    if extra_len:
        logprobs, top, error, prompt = pickle.loads(frame[offset : offset + extra_len])
    return StepResult(step_id, tokens, logprobs, top, start, end, error, counts, drafted, prompt)
