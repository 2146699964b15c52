"""Translation between async_engine.v1 messages and the engine's own types.

Everything a client can get wrong is checked here or by the engine, and reported as a
``RpcFailure`` with the proto path of the offending field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from async_engine.core.chat import ROLE_ALIASES, ROLES
from async_engine.core.group import RequestOptions
from async_engine.core.output import RequestDelta
from async_engine.core.request import FinishReason
from async_engine.server.errors import RpcFailure, invalid_argument
from async_engine.server.sampling_fields import PLACES
from async_engine.v1 import generation_pb2 as pb
from sampler.params import SamplingParams

CHAT_ROLES = (*ROLES, *ROLE_ALIASES)  # developer is read as system, as on HTTP


@dataclass(slots=True, frozen=True)
class Limits:
    """Input limits the server enforces before any tokenizing work is done."""

    max_n: int = 16
    max_prompt_chars: int = 1 << 20  # text and chat content, before tokenizing
    max_prompt_tokens: int = 1 << 17  # token_ids given directly
    max_request_id_chars: int = 256
    max_tenant_chars: int = 128
    # Stop matching runs on the event loop for every generated token: keep it bounded.
    max_stop_strings: int = 64
    max_stop_chars: int = 4096  # all stop strings together
    max_stop_token_ids: int = 256
    max_messages: int = 1024
    max_structured_chars: int = 1 << 18  # a schema, regex or grammar

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"limit {name} must be a positive integer, got {value!r}")


@dataclass(slots=True)
class Submission:
    """A GenerateRequest, decoded into what ``core.group.submit`` takes."""

    request_id: str  # "" when the client gave none
    prompt: str | list[int] | None  # None: a chat, in options.messages until templated
    params: SamplingParams  # n > 1 runs as n children (see core.fanout)
    options: RequestOptions
    prompt_field: str  # "text" | "token_ids" | "chat": where prompt errors point


def _check_sizes(msg: pb.GenerateRequest, limits: Limits) -> None:
    """Bounds on the parts whose cost grows with their size, before any work on them."""
    stop = msg.stop
    if len(stop.stop) > limits.max_stop_strings:
        raise invalid_argument(f"stop has more than {limits.max_stop_strings} strings", "stop.stop")
    if sum(len(s) for s in stop.stop) > limits.max_stop_chars:
        raise invalid_argument(
            f"stop strings are longer than {limits.max_stop_chars} characters together", "stop.stop"
        )
    if len(stop.stop_token_ids) > limits.max_stop_token_ids:
        raise invalid_argument(
            f"stop_token_ids has more than {limits.max_stop_token_ids} ids", "stop.stop_token_ids"
        )
    if len(msg.chat.messages) > limits.max_messages:
        raise invalid_argument(
            f"chat has more than {limits.max_messages} messages", "chat.messages"
        )
    kind = msg.structured_output.WhichOneof("kind") if msg.HasField("structured_output") else None
    if (
        kind not in (None, "json")
        and len(getattr(msg.structured_output, kind)) > limits.max_structured_chars
    ):
        raise invalid_argument(
            f"structured_output is longer than {limits.max_structured_chars} characters",
            f"structured_output.{kind}",
        )


def decode_request(msg: pb.GenerateRequest, limits: Limits) -> Submission:
    """Raises RpcFailure(INVALID_ARGUMENT) naming the field."""
    if len(msg.request_id) > limits.max_request_id_chars:
        raise invalid_argument(
            f"request_id is longer than {limits.max_request_id_chars} characters", "request_id"
        )
    if len(msg.tenant) > limits.max_tenant_chars:
        raise invalid_argument(
            f"tenant is longer than {limits.max_tenant_chars} characters", "tenant"
        )
    prompt, messages, prompt_field = _decode_prompt(msg, limits)
    n = msg.sampling.n or 1
    if n > limits.max_n:
        raise invalid_argument(f"n must be <= {limits.max_n}, got {n}", "sampling.n")
    _check_sizes(msg, limits)
    try:
        params = SamplingParams(**_params_kwargs(msg))
    except ValueError as exc:
        raise invalid_argument(str(exc)) from None
    options = RequestOptions(
        priority=msg.priority,
        tenant=msg.tenant,
        detokenize=not msg.output.skip_detokenize,
        max_queue_ms=msg.max_queue_ms if msg.HasField("max_queue_ms") else None,
        time_limit_ms=msg.time_limit_ms if msg.HasField("time_limit_ms") else None,
        messages=messages,
    )
    return Submission(msg.request_id, prompt, params, options, prompt_field)


def _decode_prompt(
    msg: pb.GenerateRequest, limits: Limits
) -> tuple[str | list[int] | None, list[dict[str, str]] | None, str]:
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise invalid_argument("prompt: set one of text, token_ids or chat", "prompt")
    if kind == "text":
        if len(msg.text) > limits.max_prompt_chars:
            raise invalid_argument(
                f"text is longer than {limits.max_prompt_chars} characters", "text"
            )
        return msg.text, None, "text"
    if kind == "token_ids":
        ids = list(msg.token_ids.ids)
        if len(ids) > limits.max_prompt_tokens:
            raise invalid_argument(
                f"token_ids has more than {limits.max_prompt_tokens} tokens", "token_ids.ids"
            )
        return ids, None, "token_ids"
    messages = []
    total = 0
    for i, m in enumerate(msg.chat.messages):
        # The tokenizer also checks roles, but only the server knows the proto path.
        if m.role not in CHAT_ROLES:
            # Quoted briefly: a huge role must not fill the status's metadata.
            raise invalid_argument(
                f"chat.messages[{i}].role is unknown: {m.role[:32]!r}"
                f"{'...' if len(m.role) > 32 else ''} (expected one of {', '.join(CHAT_ROLES)})",
                f"chat.messages[{i}].role",
            )
        total += len(m.content)
        messages.append({"role": m.role, "content": m.content})
    if not messages:
        raise invalid_argument("chat.messages must not be empty", "chat.messages")
    if total > limits.max_prompt_chars:
        raise invalid_argument(
            f"chat.messages are longer than {limits.max_prompt_chars} characters", "chat.messages"
        )
    return None, messages, "chat"


def _params_kwargs(msg: pb.GenerateRequest) -> dict[str, Any]:
    """SamplingParams keywords of the settings the client set; the rest keep their default."""
    kwargs: dict[str, Any] = {}
    for name, where in PLACES.items():
        if where.part:  # structured_output, a message of its own, is decoded below
            value = _setting(getattr(msg, where.part), where.field)
            if value is not None:
                kwargs[name] = value
    if msg.HasField("structured_output"):
        kind = msg.structured_output.WhichOneof("kind")
        if kind is not None:
            spec = getattr(msg.structured_output, kind)
            kwargs["structured_output"] = (kind, "" if kind == "json" else spec)
    return kwargs


def _setting(part: Message, field: FieldDescriptor) -> Any:
    """The value of ``field`` in ``part``; None where the client set none."""
    value = getattr(part, field.name)
    if field.is_repeated:
        return tuple(value) or None
    if field.has_presence:  # `optional` in the proto
        if not part.HasField(field.name):
            return None
    elif not value:
        # A plain proto3 scalar cannot tell 0 from unset: 0 keeps the engine's default
        # (n = 0 means 1). A setting whose 0 a client may mean is `optional` in the proto.
        return None
    if field.type == FieldDescriptor.TYPE_FLOAT:
        # float32 on the wire: 0.7 arrives as 0.699999988; 7 significant digits give back
        # what the client wrote.
        return float(f"{value:.7g}")
    return value


# ------------------------------------------------------------------ responses
_REASONS = {
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CONTEXT_LENGTH: pb.FINISH_REASON_CONTEXT_LENGTH,
    FinishReason.ABORTED: pb.FINISH_REASON_ABORTED,
    FinishReason.TIME_LIMIT: pb.FINISH_REASON_TIME_LIMIT,
}


def accepted(
    seq: int, request_id: str, prompt_tokens: int, cached_tokens: int
) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        seq=seq,
        accepted=pb.Accepted(
            request_id=request_id, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens
        ),
    )


def chunk(seq: int, index: int, delta: RequestDelta) -> pb.GenerateResponse:
    msg = pb.Chunk(index=index, offset=delta.offset, token_ids=delta.token_ids, text=delta.text)
    if delta.logprobs:
        msg.logprobs.extend(delta.logprobs)
    if delta.top_logprobs:
        for top in delta.top_logprobs:
            msg.top_logprobs.add(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])
    for score in (delta.prompt_logprobs or [])[1:]:
        entry = msg.prompt_logprobs.add()
        if score is not None:  # not scored (a device that computes no logits)
            logprob, rank, top = score
            entry.logprob, entry.rank = logprob, rank
            entry.top.token_ids.extend(t for t, _ in top)
            entry.top.logprobs.extend(v for _, v in top)
    return pb.GenerateResponse(seq=seq, chunk=msg)


def finished(
    seq: int, index: int, delta: RequestDelta, completion_tokens: int
) -> pb.GenerateResponse:
    """The Finished message of a final delta whose reason is a normal end (not an error)."""
    reason = delta.finish_reason
    if reason not in _REASONS:
        raise ValueError(f"{reason} is reported as a status, not as Finished")
    msg = pb.Finished(
        index=index,
        reason=_REASONS[reason],
        usage=pb.Usage(
            prompt_tokens=delta.num_prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=delta.num_cached_tokens,
        ),
        timings=pb.Timings(
            queue_s=delta.timings.get("queue_s", 0.0),
            ttft_s=delta.timings.get("ttft_s", 0.0),
            e2e_s=delta.timings.get("e2e_s", 0.0),
        ),
    )
    if isinstance(delta.stop_reason, str):
        msg.stop_str = delta.stop_reason
    elif isinstance(delta.stop_reason, int):
        msg.stop_token_id = delta.stop_reason
    return pb.GenerateResponse(seq=seq, finished=msg)


__all__ = ["Limits", "RpcFailure", "Submission", "accepted", "chunk", "decode_request", "finished"]
