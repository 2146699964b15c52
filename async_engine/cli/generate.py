"""`async-engine generate`: JSONL requests on stdin, JSONL results on stdout, in input order."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from async_engine.cli.options import add_engine_args, engine_options
from sampler.params import SamplingParams


def add_parser(sub: Any) -> None:
    gen = sub.add_parser("generate", help="JSONL requests on stdin -> JSONL results, in order")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)


PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")
OTHER_KEYS = ("id",)


def parse_line(line: str) -> tuple[dict[str, Any], SamplingParams, str | None]:
    """One JSONL request -> (prompt item, params, id). Raises ValueError naming the field."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError("line must be a JSON object")
    given = [k for k in PROMPT_KEYS if k in obj]
    if len(given) != 1:
        raise ValueError("give exactly one of prompt, prompt_token_ids, messages")
    key = given[0]
    item = {"messages": obj[key]} if key == "messages" else {"prompt": obj[key]}
    fields = {k: v for k, v in obj.items() if k not in PROMPT_KEYS + OTHER_KEYS}
    return item, SamplingParams.from_dict(fields), obj.get("id")


def cmd_generate(args: argparse.Namespace) -> int:
    from async_engine.core.llm import LLM

    lines = [line for line in sys.stdin.read().splitlines() if line.strip()]
    parsed: list[Any] = []
    for line in lines:
        try:
            parsed.append(parse_line(line))
        except ValueError as exc:
            parsed.append(exc)
    good = [e for e in parsed if not isinstance(e, Exception)]
    with LLM(**engine_options(args)) as llm:
        results = iter(llm.generate_items([e[0] for e in good], [e[1] for e in good]))
    for entry in parsed:
        if isinstance(entry, Exception):
            print(json.dumps({"error": str(entry)}), flush=True)
            continue
        rid = entry[2]
        out = next(results)
        if isinstance(out, ValueError):
            print(json.dumps({"id": rid, "error": str(out)}), flush=True)
            continue
        record = {
            "id": rid if rid is not None else out.request_id,
            "text": out.text,
            "token_ids": out.token_ids,
            "finish_reason": out.finish_reason,
            "prompt_tokens": len(out.prompt_token_ids),
            "cached_tokens": out.num_cached_tokens,
        }
        print(json.dumps(record), flush=True)
    return 0
