"""The package boundaries of DESIGN.md, checked on the source with ast."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STDLIB = set(sys.stdlib_module_names)


def imports_of(folder: str) -> dict[str, set[str]]:
    """Top-level module names each file of a package imports (relative imports excluded)."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / folder).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


def offenders(folder: str, allowed: set[str]) -> dict[str, set[str]]:
    return {
        path: bad
        for path, names in imports_of(folder).items()
        if (bad := {n for n in names if n not in allowed and n not in STDLIB})
    }


def test_blockalloc_imports_only_the_standard_library():
    assert offenders("blockalloc", {"blockalloc"}) == {}


def test_sampler_imports_only_torch():
    assert offenders("sampler", {"sampler", "torch"}) == {}


def test_streams_imports_torch_cupy_sampler_and_never_asyncio():
    assert offenders("streams", {"streams", "torch", "cupy", "sampler"}) == {}
    assert all("asyncio" not in names for names in imports_of("streams").values())


def test_scheduler_never_imports_torch():
    names = imports_of("async_engine")["async_engine/scheduler.py"]
    assert "torch" not in names
    assert names <= STDLIB | {"async_engine", "blockalloc", "streams"}


@pytest.mark.parametrize("folder", ["async_engine", "streams", "sampler", "blockalloc"])
def test_runtime_code_never_imports_profiling(folder):
    # cli.py may dispatch to the profiler lazily; the engine itself never imports it.
    files = {p: n for p, n in imports_of(folder).items() if not p.endswith("cli.py")}
    assert all("profiling" not in names for names in files.values())


def test_only_the_server_side_touches_generated_protobuf_code():
    allowed = ("async_engine/v1/", "async_engine/server", "async_engine/client")
    for path in ROOT.joinpath("async_engine").rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        if rel.startswith(allowed):
            continue
        assert "_pb2" not in path.read_text(), rel


def test_no_top_level_cuda_or_proto_python_package():
    assert not (ROOT / "cuda" / "__init__.py").exists()
    assert not (ROOT / "proto" / "__init__.py").exists()
