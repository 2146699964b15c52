"""An agent-like workload, generated from a seed: multi-turn tool loops whose last turn asks
for output that quotes earlier turns (a file written back with one change, a tool call
repeated, a JSON result passed on), as coding and tool-using agents produce.

Each conversation reads a generated source file (random names, numbers and structure) or
JSON record through a tool, then asks the model to write it back with a small change or to
call the next tool with the record: the answer re-quotes most of what the conversation
holds, which is the traffic speculative decoding's drafters find. ``history`` earlier
exchanges (other files and records read, ~150 tokens each) come first, for the long
contexts an agent's loop builds up; the ``SESSION`` loops in a row of one session share
them, as an agent's next turn shares its conversation so far (the prefix cache's case).
"""

from __future__ import annotations

import json
import random
from typing import Any

WORDS = (
    "alpha beta gamma delta window total count value index offset buffer record parse "
    "load store merge split filter score weight limit batch queue cache token frame"
).split()
SESSION = 4  # loops in a row that share their earlier exchanges
SYSTEM = "You are a coding agent. Reply with exactly one JSON tool call and nothing else."


def _name(rng: random.Random, parts: int = 2) -> str:
    return "_".join(rng.choice(WORDS) for _ in range(parts))


def _source(rng: random.Random) -> tuple[str, str]:
    """A small Python module with one function to rename; (its text, the function's name)."""
    fn, arg, acc = _name(rng), _name(rng, 1), _name(rng, 1)
    lines = [f"def {fn}({arg}s, {_name(rng, 1)}):"]
    lines.append(f"    {acc} = {rng.randint(0, 9)}")
    for _ in range(rng.randint(3, 6)):
        other = _name(rng, 1)
        lines.append(f"    for {other} in {arg}s:")
        lines.append(f"        {acc} += {other} * {rng.randint(2, 99)}")
    lines.append(f"    return {acc}")
    return "\n".join(lines) + "\n", fn


def _record(rng: random.Random) -> dict[str, Any]:
    return {
        "id": f"{_name(rng, 1)}-{rng.randint(1000, 9999)}",
        "fields": {_name(rng, 1): rng.randint(0, 500) for _ in range(rng.randint(4, 8))},
        "tags": [_name(rng, 1) for _ in range(rng.randint(2, 4))],
    }


def _read(rng: random.Random) -> tuple[dict[str, Any], str]:
    """A tool call that reads something, and its result."""
    if rng.random() < 0.5:
        text, _ = _source(rng)
        path = f"src/{_name(rng, 1)}/{_name(rng, 1)}.py"
        return {"name": "read_file", "arguments": {"path": path}}, text
    record = _record(rng)
    return {"name": "get_record", "arguments": {"id": record["id"]}}, json.dumps(record)


def _earlier(rng: random.Random, exchanges: int) -> list[dict[str, str]]:
    """Exchanges of a loop before its last turn: a thing read, its result, an answer."""
    turns = []
    for _ in range(exchanges):
        call, result = _read(rng)
        turns += [
            {
                "role": "user",
                "content": f"Look at what {call['name']} gives for {call['arguments']}.",
            },
            {"role": "assistant", "content": json.dumps(call)},
            {"role": "user", "content": f"Tool result:\n{result}"},
            {"role": "assistant", "content": "Noted."},
        ]
    return turns


def conversation(
    rng: random.Random, earlier: list[dict[str, str]] | None = None
) -> list[dict[str, str]]:
    """One tool loop (after the ``earlier`` exchanges), ending where the next answer quotes
    the conversation."""
    system = [{"role": "system", "content": SYSTEM}, *(earlier or [])]
    if rng.random() < 0.5:
        text, fn = _source(rng)
        path = f"src/{_name(rng, 1)}/{_name(rng, 1)}.py"
        new = _name(rng)
        read = {"name": "read_file", "arguments": {"path": path}}
        return [
            *system,
            {"role": "user", "content": f"Rename the function {fn} to {new} in {path}."},
            {"role": "assistant", "content": json.dumps(read)},
            {
                "role": "user",
                "content": f"Tool result:\n{text}\nNow write the whole file back with "
                f"write_file, with the function renamed to {new}.",
            },
        ]
    record = _record(rng)
    fetch = {"name": "get_record", "arguments": {"id": record["id"]}}
    return [
        *system,
        {"role": "user", "content": f"Fetch record {record['id']} and store it in the archive."},
        {"role": "assistant", "content": json.dumps(fetch)},
        {
            "role": "user",
            "content": f"Tool result:\n{json.dumps(record)}\nNow call store_record with the "
            "whole record as its argument.",
        },
    ]


def conversations(count: int, seed: int, history: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if i % SESSION == 0:
            earlier = _earlier(rng, history)
        out.append(conversation(rng, earlier))
    return out
