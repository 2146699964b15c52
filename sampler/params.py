"""Per-request sampling settings, validated once when the request arrives."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20
_MAX_SEED = 2**64 - 1
# Constrained decoding: (kind, spec). "json": any JSON value (spec ""); "json_schema": a
# JSON Schema as a JSON string; "regex": a regular expression; "grammar": EBNF (GBNF).
STRUCTURED_KINDS = ("json", "json_schema", "regex", "grammar", "lark")
MAX_STRUCTURED_SPEC = 1 << 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: until the context length
    min_tokens: int = 0
    temperature: float = 1.0  # 0 -> greedy
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs; 0 = only the sampled token's logprob
    n: int = 1
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_output: tuple[str, str] | None = None  # see STRUCTURED_KINDS

    def __post_init__(self) -> None:
        self._check_types()
        self._check_ranges()

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

    def _check_types(self) -> None:
        for name in ("min_tokens", "top_k", "n"):
            _require_int(name, getattr(self, name))
        for name in ("max_tokens", "seed", "logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require_int(name, value)
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            # Ints are fine here (JSON "temperature": 1), but store floats so that
            # equality and to_dict() do not depend on how the user spelled the number.
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")

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

    def _check_ranges(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        # `not (0 < p <= 1)` also catches NaN, which fails every comparison.
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        rep = self.repetition_penalty
        if not math.isfinite(rep) or rep <= 0:
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {rep}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain an empty string")
        bad_ids = [i for i in self.stop_token_ids if i < 0]
        if bad_ids:
            raise ValueError(f"stop_token_ids must be >= 0, got {bad_ids}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs must be <= {MAX_LOGPROBS}, got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed <= _MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64 - 1], got {self.seed}")


def _require_int(name: str, value: object) -> None:
    # bool is a subclass of int; `max_tokens: true` is a client bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
