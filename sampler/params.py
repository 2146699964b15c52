"""Per-request sampling settings, validated once when the request arrives.

Each field is declared once, here: its type and default on the class, and through ``param``
its ranges, a line of help and its OpenAI HTTP key. ``FIELDS`` reads those declarations back
for the front ends, which derive their field lists from it: the gRPC codec and error paths
(laid onto the proto descriptor by name, server side: this package imports no protobuf) and
the HTTP body parser. A new setting is a field here and one in the proto.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20
_MAX_SEED = 2**64 - 1
# Constrained decoding: (kind, spec). "json": any JSON value (spec ""); "json_schema": a
# JSON Schema as a JSON string; "regex": a regular expression; "grammar": EBNF (GBNF).
STRUCTURED_KINDS = ("json", "json_schema", "regex", "grammar", "lark")
MAX_STRUCTURED_SPEC = 1 << 20


@dataclass(frozen=True, slots=True)
class Rule:
    """A range; a value outside it is ValueError("<field> <says>, got <value>")."""

    says: str
    holds: Callable[[Any], bool]  # written so that NaN fails it (NaN fails every comparison)


def at_least(low: int) -> Rule:
    return Rule(f"must be >= {low}", lambda v: v >= low)


def within(low: int, high: int) -> Rule:
    return Rule(f"must be in [{low}, {high}]", lambda v: low <= v <= high)


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One SamplingParams field as the front ends see it; FIELDS holds one per field."""

    name: str
    kind: type  # int, float or bool: checked off this table; tuple: checked by hand
    nullable: bool  # None is a value of it (max_tokens None: up to the context length)
    default: Any
    help: str
    rules: tuple[Rule, ...]  # in order; the first that fails is the error
    http: str | None  # its OpenAI body key; None: HTTP does not offer it
    grpc: bool  # False: no GenerateRequest field carries it


def param(default: Any, help: str, *rules: Rule, http: str | None = "", grpc: bool = True) -> Any:
    """A SamplingParams field's default with the rest of its ParamSpec (http "": its name)."""
    return dataclasses.field(default=default, metadata={"param": (help, rules, http, grpc)})


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int | None = param(
        16, "tokens to generate at most; None: up to the context length", at_least(1)
    )
    min_tokens: int = param(0, "tokens to generate before EOS or a stop may end", at_least(0))
    temperature: float = param(
        1.0,
        "divides the logits; 0: greedy",
        Rule("must be >= 0 and finite", lambda v: v >= 0 and math.isfinite(v)),
    )
    top_k: int = param(
        -1,
        "sample among the k likeliest tokens; -1 or 0: off",
        Rule("must be -1, 0 (off) or positive", lambda v: v >= -1),
    )
    top_p: float = param(
        1.0,
        "sample among the likeliest tokens whose probabilities sum to top_p",
        Rule("must be in (0, 1]", lambda v: 0 < v <= 1),
    )
    min_p: float = param(
        0.0, "drop tokens less likely than min_p times the likeliest", within(0, 1)
    )
    repetition_penalty: float = param(
        1.0,
        "scales down the logits of tokens in the prompt or output; 1: off",
        Rule("must be > 0 and finite", lambda v: v > 0 and math.isfinite(v)),
    )
    presence_penalty: float = param(0.0, "subtracted from generated tokens' logits", within(-2, 2))
    frequency_penalty: float = param(
        0.0, "subtracted from a generated token's logit once per occurrence", within(-2, 2)
    )
    seed: int | None = param(
        None,
        "seeds the request's random draws; None: unseeded",
        Rule("must be in [0, 2**64 - 1]", lambda v: 0 <= v <= _MAX_SEED),
    )
    stop: tuple[str, ...] = param((), "strings that end the output (a str: one)")
    stop_token_ids: tuple[int, ...] = param((), "token ids that end the output")
    ignore_eos: bool = param(False, "generate past EOS (benchmarks)")
    logprobs: int | None = param(
        None,
        "top-n logprobs per token; 0: only the sampled token's logprob",
        at_least(0),
        Rule(f"must be <= {MAX_LOGPROBS}", lambda v: v <= MAX_LOGPROBS),
    )
    prompt_logprobs: int | None = param(
        None,
        "the prompt's own logprobs: each prompt token's (after the first) under the model, "
        "with the top-n at its position; 0: the token's only",
        at_least(0),
        Rule(f"must be <= {MAX_LOGPROBS}", lambda v: v <= MAX_LOGPROBS),
    )
    n: int = param(1, "samples of the prompt, seeded seed, seed + 1, ...", at_least(1))
    include_stop_str_in_output: bool = param(
        False, "keep the stop string that ended the output in its text", http=None
    )
    skip_special_tokens: bool = param(
        True, "leave special tokens out of the text", http=None, grpc=False
    )
    speculate: bool = param(
        True,
        "where the engine speculates, draft and verify tokens for this request; false: one "
        "token a step (latency-insensitive batch work leaves the device's time to others)",
    )
    # HTTP also takes it as guided_regex, guided_grammar or tools (http/protocol.py).
    structured_output: tuple[str, str] | None = param(
        None, "constrain the output: (kind, spec), see STRUCTURED_KINDS", http="response_format"
    )

    def __post_init__(self) -> None:
        for spec in FIELDS:
            self._check_type(spec)
        self._check_lists()
        for spec in FIELDS:
            value = getattr(self, spec.name)
            for rule in spec.rules if value is not None else ():
                if not rule.holds(value):
                    raise ValueError(f"{spec.name} {rule.says}, got {value}")
        # Across fields and within lists: not a per-field range, so not in the table.
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain an empty string")
        bad_ids = [i for i in self.stop_token_ids if i < 0]
        if bad_ids:
            raise ValueError(f"stop_token_ids must be >= 0, got {bad_ids}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_sample(self, index: int) -> SamplingParams:
        """Params of sample ``index`` of ``n``: one sequence, seed + index (distinct outputs)."""
        seed = None if self.seed is None else (self.seed + index) % (_MAX_SEED + 1)
        return dataclasses.replace(self, n=1, seed=seed)

    def to_dict(self) -> dict[str, Any]:
        # Lists, not tuples, so that the dict round-trips through JSON unchanged.
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        if not isinstance(data, dict):
            raise ValueError(f"sampling params must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling params: {', '.join(map(str, unknown))}")
        return cls(**data)

    def _check_type(self, spec: ParamSpec) -> None:
        name, value = spec.name, getattr(self, spec.name)
        if value is None and spec.nullable:
            return
        if spec.kind is int:
            _require_int(name, value)
        elif spec.kind is float:
            # Ints are fine here (JSON "temperature": 1), but store floats so that
            # equality and to_dict() do not depend on how the user spelled the number.
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number, got {value!r}")
            object.__setattr__(self, name, float(value))
        elif spec.kind is bool and not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")

    def _check_lists(self) -> None:
        """stop, stop_token_ids, structured_output: each list has its own shape and message."""
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, list | tuple):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {s!r}")
        object.__setattr__(self, "stop", tuple(stop))

        ids = self.stop_token_ids
        if not isinstance(ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of ints, got {ids!r}")
        for i in ids:
            _require_int("stop_token_ids", i)
        object.__setattr__(self, "stop_token_ids", tuple(ids))

        spec = self.structured_output
        if spec is not None:
            if not isinstance(spec, list | tuple) or len(spec) != 2:
                raise ValueError(f"structured_output must be (kind, spec), got {spec!r}")
            kind, text = spec
            if kind not in STRUCTURED_KINDS:
                raise ValueError(
                    f"structured_output kind must be one of "
                    f"{', '.join(STRUCTURED_KINDS)}, got {kind!r}"
                )
            if not isinstance(text, str) or len(text) > MAX_STRUCTURED_SPEC:
                raise ValueError(
                    f"structured_output spec must be a string under "
                    f"{MAX_STRUCTURED_SPEC} characters"
                )
            if self.ignore_eos:
                raise ValueError("structured_output ends at the grammar's end: no ignore_eos")
            object.__setattr__(self, "structured_output", (kind, text))


def _require_int(name: str, value: object) -> None:
    # bool is a subclass of int; `max_tokens: true` is a client bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")


def _spec(field: dataclasses.Field[Any], hint: Any) -> ParamSpec:
    if "param" not in field.metadata:
        raise TypeError(f"SamplingParams.{field.name}: declare it with param(...)")
    help, rules, http, grpc = field.metadata["param"]
    # `int | None` -> int, nullable; `tuple[str, ...]` -> tuple.
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    (base,) = (a for a in args if a is not type(None))
    kind = typing.get_origin(base) or base
    key = field.name if http == "" else http
    return ParamSpec(field.name, kind, type(None) in args, field.default, help, rules, key, grpc)


_HINTS = typing.get_type_hints(SamplingParams)
FIELDS: tuple[ParamSpec, ...] = tuple(
    _spec(f, _HINTS[f.name]) for f in dataclasses.fields(SamplingParams)
)
