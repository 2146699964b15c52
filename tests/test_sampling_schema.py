"""SamplingParams is declared once (sampler.params.FIELDS) and every front end derives from it.

The cases here are generated from FIELDS, so a field added to SamplingParams that a front
end does not carry fails them without a test being written for it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from async_engine.client.messages import build_request
from async_engine.server import http
from async_engine.server.codec import Limits, decode_request
from async_engine.server.errors import RpcFailure, invalid_argument
from async_engine.server.http.errors import HttpError
from async_engine.server.http.protocol import JSON_OBJECT, completion_request
from async_engine.server.sampling_fields import PLACES, _placed
from async_engine.v1 import generation_pb2 as pb
from async_engine.v1.fields import place
from sampler.params import FIELDS, ParamSpec, SamplingParams

GRPC = [s for s in FIELDS if s.grpc]
HTTP = [s for s in FIELDS if s.http is not None]
# The list-shaped fields have no value to derive from their type: one example each.
LIST_EXAMPLES: dict[str, Any] = {
    "stop": ("x",),
    "stop_token_ids": (7,),
    "structured_output": ("regex", "a+"),
}
# Where HTTP spells a value otherwise: body value -> what SamplingParams then holds.
HTTP_SPELLINGS = {"structured_output": ({"type": "json_object"}, ("json_schema", JSON_OBJECT))}


def name_of(spec: ParamSpec) -> str:
    return spec.name


def example(spec: ParamSpec) -> Any:
    """A valid value of the field other than its default (exact in float32)."""
    if spec.kind is tuple:
        assert spec.name in LIST_EXAMPLES, f"give {spec.name} a value in LIST_EXAMPLES"
        return LIST_EXAMPLES[spec.name]
    if spec.kind is bool:
        return not spec.default
    candidates = (2, 3) if spec.kind is int else (0.5, 0.25)
    return next(v for v in candidates if v != spec.default and all(r.holds(v) for r in spec.rules))


def grpc_request(name: str, value: Any) -> pb.GenerateRequest:
    """A request that sets field ``name`` where the proto keeps it, without the client."""
    msg = pb.GenerateRequest(text="hi")
    where = place(name)
    assert where is not None, name
    if not where.part:  # structured_output: (kind, spec) is the oneof's case and its value
        kind, spec = value
        setattr(msg.structured_output, kind, spec)
    elif where.field.is_repeated:
        getattr(getattr(msg, where.part), where.field.name).extend(value)
    else:
        setattr(getattr(msg, where.part), where.field.name, value)
    return msg


def violations(failure: RpcFailure) -> list[str]:
    return [v.field for d in failure.details for v in d.field_violations]


def bad_on_the_wire(spec: ParamSpec) -> int | float | None:
    """A number the field's proto type carries that its ranges refuse; None if there is none
    (seed is a uint64, n = 0 means 1, min_tokens is unsigned)."""
    field = PLACES[spec.name].field
    unsigned = field.type in (field.TYPE_UINT32, field.TYPE_UINT64)
    for value in (-5, 0, 1.5, 99):
        if isinstance(value, float) and spec.kind is int:
            continue
        if (unsigned and value < 0) or (value == 0 and not field.has_presence):
            continue  # not sendable, or read as unset
        if any(not rule.holds(value) for rule in spec.rules):
            return value
    return None


WIRE_BAD = [s for s in GRPC if s.rules and bad_on_the_wire(s) is not None]


# ---------------------------------------------------------------- reaching SamplingParams
@pytest.mark.parametrize("spec", GRPC, ids=name_of)
def test_every_grpc_field_reaches_sampling_params(spec: ParamSpec) -> None:
    msg = grpc_request(spec.name, example(spec))
    params = decode_request(msg, Limits()).params
    assert getattr(params, spec.name) == example(spec)


@pytest.mark.parametrize("spec", GRPC, ids=name_of)
def test_the_client_sets_every_grpc_field_by_its_engine_name(spec: ParamSpec) -> None:
    msg = build_request("hi", **{spec.name: example(spec)})
    assert getattr(decode_request(msg, Limits()).params, spec.name) == example(spec)


@pytest.mark.parametrize("spec", HTTP, ids=name_of)
def test_every_field_http_offers_reaches_sampling_params(spec: ParamSpec) -> None:
    value = example(spec)
    given = list(value) if isinstance(value, tuple) else value
    given, value = HTTP_SPELLINGS.get(spec.name, (given, value))
    body = {"model": "m", "prompt": "hi", spec.http: given}
    assert getattr(completion_request(body).params, spec.name) == value


def test_a_field_declared_off_grpc_has_no_proto_field() -> None:
    # Else the proto would carry it and the codec silently drop it.
    off = [s.name for s in FIELDS if not s.grpc]
    assert off and all(place(name) is None for name in off)


def test_an_unset_grpc_request_decodes_to_the_defaults() -> None:
    assert decode_request(pb.GenerateRequest(text="hi"), Limits()).params == SamplingParams()


# ---------------------------------------------------------------------- naming the field
@pytest.mark.parametrize("spec", GRPC, ids=name_of)
def test_every_fields_bad_value_names_its_proto_path(spec: ParamSpec) -> None:
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{spec.name: object()})  # no field takes one
    assert violations(invalid_argument(str(exc.value))) == [place(spec.name).path]


@pytest.mark.parametrize("spec", WIRE_BAD, ids=name_of)
def test_an_out_of_range_value_on_the_wire_is_invalid_argument_naming_its_path(
    spec: ParamSpec,
) -> None:
    with pytest.raises(RpcFailure) as info:
        decode_request(grpc_request(spec.name, bad_on_the_wire(spec)), Limits())
    assert info.value.code.name == "INVALID_ARGUMENT"
    assert info.value.message.startswith(spec.name)
    assert violations(info.value) == [place(spec.name).path]


def test_the_fields_the_proto_spells_otherwise_keep_their_paths() -> None:
    assert place("include_stop_str_in_output").path == "stop.include_stop_str"
    assert place("logprobs").path == "output.logprobs"
    assert place("structured_output").path == "structured_output"


@pytest.mark.parametrize("spec", HTTP, ids=name_of)
def test_every_fields_bad_http_value_is_a_400_naming_its_key(spec: ParamSpec) -> None:
    body = {"model": "m", "prompt": "hi", spec.http: {"not": "a value"}}
    with pytest.raises(HttpError) as info:
        completion_request(body)
    assert info.value.status == 400 and info.value.param == spec.http


def test_a_field_http_spells_otherwise_is_read_and_named_by_its_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    renamed = [
        dataclasses.replace(s, http="temp") if s.name == "temperature" else s for s in FIELDS
    ]
    monkeypatch.setattr(http.protocol, "FIELDS", tuple(renamed))
    body = {"model": "m", "prompt": "hi"}
    assert completion_request({**body, "temp": 0.5}).params.temperature == 0.5
    with pytest.raises(HttpError) as info:
        completion_request({**body, "temp": -1})
    assert info.value.param == "temp"


def test_a_setting_missing_from_the_proto_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="SamplingParams.no_such_setting has no field"):
        _placed("no_such_setting")


# ----------------------------------------------------- the messages, exactly as they were
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": True}, "max_tokens must be an int, got True"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens must be <= max_tokens (3), got 9"),
        ({"temperature": -1}, "temperature must be >= 0 and finite, got -1.0"),
        ({"temperature": math.inf}, "temperature must be >= 0 and finite, got inf"),
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"top_k": -2}, "top_k must be -1, 0 (off) or positive, got -2"),
        ({"top_k": 1.0}, "top_k must be an int, got 1.0"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": math.nan}, "top_p must be in (0, 1], got nan"),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0 and finite, got 0.0"),
        ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2], got -3.0"),
        ({"frequency_penalty": math.nan}, "frequency_penalty must be in [-2, 2], got nan"),
        ({"seed": 2**64}, "seed must be in [0, 2**64 - 1], got 18446744073709551616"),
        ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
        ({"stop": [1]}, "stop must contain only strings, got 1"),
        ({"stop": ["a", ""]}, "stop must not contain an empty string"),
        ({"stop_token_ids": [-1, 2, -3]}, "stop_token_ids must be >= 0, got [-1, -3]"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1"),
        ({"logprobs": -1}, "logprobs must be >= 0, got -1"),
        ({"logprobs": 21}, "logprobs must be <= 20, got 21"),
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"n": None}, "n must be an int, got None"),
        ({"skip_special_tokens": 0}, "skip_special_tokens must be a bool, got 0"),
        ({"structured_output": "x"}, "structured_output must be (kind, spec), got 'x'"),
        (
            {"structured_output": ("regex", "a"), "ignore_eos": True},
            "structured_output ends at the grammar's end: no ignore_eos",
        ),
    ],
)
def test_a_bad_value_keeps_its_error_message(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    assert str(exc.value) == message
