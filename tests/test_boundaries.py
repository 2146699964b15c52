"""Which folder may import which: one table, checked on the source with ast.

Every import counts, including those inside functions, so a lazy import cannot slip a
dependency past the rules. The standard library is allowed everywhere except where a rule
names a module in FORBIDDEN.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STDLIB = set(sys.stdlib_module_names)
PACKAGES = ("async_engine", "streams", "sampler", "blockalloc", "profiling")

# folder (or file) -> modules it may import besides the standard library; a dotted name
# allows that module and everything under it. The most specific entry wins.
CORE = ["async_engine.core", "async_engine.model", "blockalloc", "sampler", "streams"]
ALLOWED: dict[str, list[str]] = {
    "blockalloc": ["blockalloc"],
    "sampler": ["sampler", "torch"],
    "streams": ["streams", "sampler", "torch", "cupy", "numpy"],
    # Constrained decoding: llguidance, and the tokenizer's vocabulary it is compiled against.
    "streams/grammar.py": ["streams", "torch", "numpy", "llguidance", "transformers"],
    "async_engine/model": [
        "async_engine.model",
        "streams.batch",
        "torch",
        "transformers",
        "safetensors",
        "gguf",
        "numpy",
    ],
    # The KV store of the CUDA path is cuda/kv_cache.cu, loaded by streams.cuda_kernels.
    "async_engine/model/attention.py": [
        "async_engine.model",
        "streams.batch",
        "streams.cuda_kernels",
        "torch",
    ],
    # The step's attention layout, planned once per forward: attention.py's rule less the KV
    # store (streams.cuda_kernels).
    "async_engine/model/attention_plan.py": ["async_engine.model", "streams.batch", "torch"],
    # Triton kernels for the CUDA device; triton is imported lazily, never by the CPU engine.
    "async_engine/model/gpu_kernels": ["async_engine.model", "torch", "numpy", "triton"],
    # The scheduler plans with plain ints and lists: no torch, no model. So do the parts it
    # was split into and its policies.
    "async_engine/core/scheduler.py": [
        "async_engine.core",
        "blockalloc",
        "streams.plan",
        "streams.drafting.config",
        "numpy",
    ],
    "async_engine/core/speculation.py": [
        "async_engine.core",
        "streams.plan",
        "streams.drafting.config",
        "numpy",
    ],
    "async_engine/core/plan_builder.py": ["async_engine.core", "streams.plan", "numpy"],
    "async_engine/core/step_results.py": ["async_engine.core", "streams.plan", "numpy"],
    "async_engine/core/row_chooser.py": ["async_engine.core", "streams.plan", "numpy"],
    "async_engine/core/row_table.py": ["async_engine.core", "numpy"],
    "async_engine/core/running.py": ["async_engine.core", "numpy"],
    "async_engine/core/device_loss.py": ["async_engine.core"],
    "async_engine/core/ledger.py": ["async_engine.core", "blockalloc"],
    "async_engine/core/queues.py": ["async_engine.core"],
    "async_engine/core/policy": ["async_engine.core"],
    "async_engine/core/kv_manager.py": ["async_engine.core", "blockalloc"],
    "async_engine/core/request.py": [],
    "async_engine/core": [*CORE, "torch", "uvloop", "structlog", "transformers", "numpy"],
    # The engine hands its pool to the KV event publisher: the one core file that may.
    "async_engine/core/engine.py": [
        *CORE,
        "async_engine.kv_events",
        "torch",
        "uvloop",
        "structlog",
        "transformers",
        "numpy",
    ],
    # KV events in vLLM's format (pool -> batches -> ZeroMQ); the pool itself stays pure.
    "async_engine/kv_events": ["async_engine.kv_events", "zmq", "msgpack"],
    "async_engine/ray_serve": [
        *CORE,
        "async_engine.ray_serve",
        "async_engine.server",
        "ray",
        "structlog",
    ],
    "async_engine/ray_serve/measure.py": [
        *CORE,
        "async_engine.ray_serve",
        "async_engine.bench",
        "async_engine.cli.options",
    ],
    "async_engine/server": [
        *CORE,
        "async_engine.server",
        "async_engine.v1",
        "grpc",
        "grpc_health",
        "grpc_reflection",
        "grpc_status",
        "google",
        "prometheus_client",
        "structlog",
        "uvloop",
        "starlette",
        "uvicorn",
        "jsonschema",
    ],
    "async_engine/client": [
        "async_engine.client",
        "async_engine.v1",
        "grpc",
        "grpc_health",
        "google",
    ],
    "async_engine/v1": ["async_engine.v1", "grpc", "google"],
    "async_engine/bench": [
        *CORE,
        "async_engine.bench",
        "async_engine.client",
        "async_engine.cli.options",
        "torch",
        "transformers",
        "matplotlib",
        "prometheus_client",
        "uvloop",
    ],
    # Runs in vLLM's own interpreter (bench offline --vllm-python): stdlib and vllm only.
    "async_engine/bench/peers/vllm_driver.py": ["vllm"],
    # make gpu-check's driver runs `bench` and `profile` in process (the GPU host lacks the
    # server's packages) on weights it writes itself.
    "async_engine/bench/gpu_models.py": [
        *CORE,
        "async_engine.bench",
        "async_engine.cli.bench",
        "async_engine.cli.profile",
        "torch",
        "safetensors",
    ],
    # Entry points: the only runtime-side code that may reach the profiler.
    "async_engine/cli": [*CORE, "async_engine", "profiling", "uvloop", "structlog"],
    "async_engine/__init__.py": ["async_engine.core", "sampler"],
    "profiling": [
        "profiling",
        "async_engine.core",
        "sampler",
        "streams.plan",
        "matplotlib",
        "torch",
    ],
}
FORBIDDEN: dict[str, set[str]] = {"streams": {"asyncio"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, type_only_too: bool = False) -> set[str]:
    """Absolute names of every module a file imports, anywhere in the file; with
    ``type_only_too``, those under ``if TYPE_CHECKING:`` as well."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if type_only_too else runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            # `from pkg import mod` imports pkg.mod when mod is a module.
            found.update(f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}"))
    return found


def runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node, less the bodies of ``if TYPE_CHECKING:`` (annotations only, never run)."""
    nodes: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def source_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def rule_for(rel: str) -> str:
    keys = [k for k in ALLOWED if rel == k or rel.startswith(k.rstrip("/") + "/")]
    if not keys:
        raise AssertionError(f"{rel} has no import rule: add its folder to ALLOWED")
    return max(keys, key=len)


def allowed(name: str, rule: str) -> bool:
    top = name.split(".")[0]
    if top in FORBIDDEN.get(rule.split("/")[0], set()):
        return False
    if top in STDLIB:
        return True
    return any(name == a or name.startswith(a + ".") for a in ALLOWED[rule])


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_import_follows_its_folder_rule(path):
    rel = path.relative_to(ROOT).as_posix()
    rule = rule_for(rel)
    bad = sorted(n for n in imported_modules(path) if not allowed(n, rule))
    assert bad == [], f"{rel} (rule {rule!r}) imports {bad}"


def test_the_rules_catch_a_forbidden_import():
    assert not allowed("torch", rule_for("async_engine/core/scheduler.py"))
    assert not allowed("torch", rule_for("async_engine/core/policy/fair.py"))
    assert not allowed("asyncio", rule_for("streams/plan.py"))
    assert not allowed("profiling.tracer", rule_for("async_engine/core/engine.py"))
    assert not allowed("async_engine.v1.generation_pb2", rule_for("async_engine/core/engine.py"))
    assert allowed("profiling.capture", rule_for("async_engine/cli/serve.py"))


def module_graph(type_only_too: bool) -> dict[str, set[str]]:
    """Each project module and the project modules it imports."""
    graph: dict[str, set[str]] = {}
    for path in source_files():
        name = module_name(path)
        # A package's __init__ importing its own modules is how packages work, not a cycle.
        graph[name] = {
            n
            for n in imported_modules(path, type_only_too)
            if _is_module(n) and n != name and not name.startswith(n + ".")
        }
    return graph


def test_no_import_cycle_between_modules():
    cycle = find_cycle(module_graph(type_only_too=False))
    assert cycle is None, " -> ".join(cycle or [])


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_import_cycle_even_through_type_only_imports():
    """An import under ``if TYPE_CHECKING:`` never runs, but it still ties two modules
    together: neither can be read, changed or moved without the other."""
    graph = module_graph(type_only_too=True)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle (type-only imports count): " + " -> ".join(cycle or [])


def test_find_cycle_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_only_the_server_and_client_touch_generated_protobuf_code():
    for path in (ROOT / "async_engine").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(("async_engine/v1/", "async_engine/server/", "async_engine/client/")):
            assert "_pb2" not in path.read_text(), rel


def test_no_top_level_cuda_or_proto_python_package():
    assert not (ROOT / "cuda" / "__init__.py").exists()
    assert not (ROOT / "proto" / "__init__.py").exists()
