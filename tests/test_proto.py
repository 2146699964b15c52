"""The committed gRPC stubs match proto/ (regenerate with `make proto`)."""

from __future__ import annotations

import ast
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO = "async_engine/v1/generation.proto"
GENERATED = ("generation_pb2.py", "generation_pb2_grpc.py", "generation_pb2.pyi")


def test_committed_stubs_equal_freshly_generated_ones(tmp_path: Path) -> None:
    args = [
        "protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
        f"--pyi_out={tmp_path}", str(ROOT / "proto" / PROTO),
    ]  # fmt: skip
    assert protoc.main(args) == 0
    for name in GENERATED:
        fresh = (tmp_path / "async_engine" / "v1" / name).read_text()
        committed = (ROOT / "async_engine" / "v1" / name).read_text()
        assert fresh == committed, f"{name} is stale: run `make proto`"


def test_stubs_import_as_a_package_module() -> None:
    from async_engine.v1 import generation_pb2, generation_pb2_grpc

    assert generation_pb2.DESCRIPTOR.package == "async_engine.v1"
    assert hasattr(generation_pb2_grpc, "GenerationStub")


def test_only_server_and_client_modules_import_the_generated_code() -> None:
    allowed = {"server.py", "server_app.py", "server_codec.py", "client.py"}
    offenders = []
    for path in ROOT.glob("*/**/*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".venv") or rel.parts[:2] == ("async_engine", "v1"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.startswith("async_engine.v1") for n in names) and path.name not in allowed:
                offenders.append(str(rel))
    assert offenders == []
