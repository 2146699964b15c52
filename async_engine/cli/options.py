"""Engine flags, generated once from ``EngineConfig``'s fields, defaults and help."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any

from async_engine.core.config import EngineConfig

# Settings a command line does not offer (tests and the library set them directly).
HIDDEN = frozenset()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_type(f: dataclasses.Field) -> type:
    hint = typing.get_type_hints(EngineConfig)[f.name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _on_off(text: str) -> bool:
    text = text.lower()
    if text in ("on", "true", "1", "yes"):
        return True
    if text in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in HIDDEN:
            continue
        kind = _value_type(f)
        help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
        if kind is bool:
            group.add_argument(
                _flag(f.name), type=_on_off, default=f.default, metavar="on|off", help=help_text
            )
        else:
            group.add_argument(
                _flag(f.name),
                type=kind,
                default=f.default,
                choices=f.metadata.get("choices"),
                help=help_text,
            )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig keyword arguments a parsed command line carries."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if f.name not in HIDDEN and hasattr(args, f.name)
    }


def engine_argv(options: dict[str, Any]) -> list[str]:
    """Flags that reproduce ``options`` on another command line (a server subprocess)."""
    argv: list[str] = []
    for name, value in options.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = "on" if value else "off"
        elif isinstance(value, dict):  # speculative_config, as LLM(...) takes it
            value = json.dumps(value)
        argv += [_flag(name), str(value)]
    return argv
