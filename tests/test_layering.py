"""The package layering, read from the sources with ``ast`` (nothing is imported):

- the engine library (``detserve``) imports no serving, load-generation, benchmark or
  deployment code, and none of the serving stack's libraries;
- the decoder does not import the router (what both need lives in a module below both);
- no import cycle among the modules of ``detserve``, ``services``, ``loadgen``,
  ``benchmarks`` and ``deploy``, counting every import: at module level, inside
  functions and under ``TYPE_CHECKING`` (a function-level import does not hide a cycle);
- test helpers stay under ``tests/``: no package module imports one or is named ``testing``.

The checker runs on synthetic module sets too, so a cycle or a forbidden import is shown
to be reported (the negative controls).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("detserve", "services", "loadgen", "benchmarks", "deploy")
# what the engine library must not import: the repository's other packages, and the
# libraries of the serving stack (they belong to services/)
ENGINE_FORBIDDEN = ("services", "loadgen", "benchmarks", "deploy", "tests", "redis", "ray",
                    "fastapi", "starlette", "uvicorn", "grpc", "pydantic", "prometheus_client",
                    "httpx")
# test helper modules (tests/*.py, imported by tests as top-level names)
TEST_HELPERS = tuple(sorted(p.stem for p in (ROOT / "tests").glob("*.py")
                            if not p.stem.startswith("test_") and p.stem != "conftest"))


@dataclass(frozen=True)
class Source:
    text: str
    is_package: bool = False  # an ``__init__.py``: relative imports start from the module itself


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # what it names, absolute: a module, or ``module.attribute`` for ``from`` imports
    line: int


def package_sources(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Source]:
    """Every ``.py`` module under ``packages``, by dotted name."""
    out: dict[str, Source] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            out[".".join(parts)] = Source(path.read_text(), is_package)
    return out


def imports_of(module: str, source: Source) -> list[Import]:
    """Every import statement of a module, wherever it stands, relative ones made absolute."""
    found: list[Import] = []
    for node in ast.walk(ast.parse(source.text, filename=module)):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if source.is_package else 0)
                if keep < 1:
                    raise ValueError(f"{module}:{node.lineno}: relative import beyond the top")
                base = ".".join([*parts[:keep], *([base] if base else [])])
            found += [Import(module, base if alias.name == "*" else f"{base}.{alias.name}",
                             node.lineno) for alias in node.names]
    return found


def _owner(target: str, modules: Iterable[str]) -> str | None:
    """The known module a target names: the longest dotted prefix that is one."""
    known = set(modules)
    parts = target.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts) if parts else None


def module_graph(sources: Mapping[str, Source]) -> dict[str, dict[str, int]]:
    """module -> {module of the set it imports: line of the first such import}."""
    graph: dict[str, dict[str, int]] = {m: {} for m in sources}
    for module, source in sources.items():
        for imp in imports_of(module, source):
            owner = _owner(imp.target, sources)
            if owner is not None and owner != module:
                graph[module].setdefault(owner, imp.line)
    return graph


def cycles(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan's
    algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next((w for w in edges if w not in index or w in on_stack), None)
            if nxt is not None and nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph.get(nxt, {})))))
                continue
            if nxt is not None:  # on the stack: a back edge
                low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def describe_cycles(graph: Mapping[str, Mapping[str, int]]) -> list[str]:
    """One line per cycle: its members and the imports that join them."""
    lines = []
    for members in cycles(graph):
        edges = [f"{a}:{graph[a][b]} -> {b}" for a in members for b in sorted(graph[a])
                 if b in members]
        lines.append(f"{members}: {'; '.join(edges)}")
    return lines


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def forbidden_imports(sources: Mapping[str, Source], importers: Iterable[str],
                      banned: Iterable[str]) -> list[str]:
    """'module:line imports target' for every import by a module under ``importers`` of
    anything under ``banned``."""
    importers, banned = tuple(importers), tuple(banned)
    return [f"{imp.module}:{imp.line} imports {imp.target}"
            for module, source in sorted(sources.items()) if _under(module, importers)
            for imp in imports_of(module, source) if _under(imp.target, banned)]


# --- the repository ----------------------------------------------------------------------

SOURCES = package_sources()


def test_sources_found() -> None:
    for name in ("detserve.engine", "detserve.executor.runner", "services.decoder.messages",
                 "services.router.load_ledger", "deploy.k8s.policy", "benchmarks.bench_offline",
                 "loadgen.cli"):
        assert name in SOURCES
    assert SOURCES["detserve"].is_package and not SOURCES["detserve.engine"].is_package


def test_engine_library_imports_no_serving_code() -> None:
    assert forbidden_imports(SOURCES, ["detserve"], ENGINE_FORBIDDEN) == []


def test_decoder_does_not_import_router() -> None:
    assert forbidden_imports(SOURCES, ["services.decoder"], ["services.router"]) == []


def test_no_import_cycles() -> None:
    assert describe_cycles(module_graph(SOURCES)) == []


def test_test_helpers_live_under_tests() -> None:
    assert {"engine_utils", "kernel_helpers", "model_helpers"} <= set(TEST_HELPERS)
    assert forbidden_imports(SOURCES, PACKAGES, TEST_HELPERS) == []
    assert [m for m in SOURCES if "testing" in m.split(".")] == []


# --- negative controls: the checker reports what it is meant to -------------------------

def _sources(**modules: str) -> dict[str, Source]:
    """Synthetic modules: keyword ``a__b`` is module ``a.b``; a trailing ``__init__`` marks
    a package."""
    out = {}
    for key, text in modules.items():
        name = key.replace("__", ".")
        is_package = name.endswith(".init")
        out[name.removesuffix(".init")] = Source(text, is_package)
    return out


def test_control_cycle_hidden_in_a_function_is_reported() -> None:
    src = _sources(pkg__a="from pkg.b import helper\n",
                   pkg__b="def helper():\n    from pkg.a import thing\n    return thing\n",
                   pkg__c="import pkg.a\n")
    graph = module_graph(src)
    assert graph["pkg.b"] == {"pkg.a": 2}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    assert describe_cycles(graph) == ["['pkg.a', 'pkg.b']: pkg.a:1 -> pkg.b; pkg.b:2 -> pkg.a"]


def test_control_cycles_through_type_checking_and_relative_imports_are_reported() -> None:
    src = _sources(
        pkg__init="",
        pkg__x="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.z import Z\n",
        pkg__y="from .x import X\n",
        pkg__z="from . import y\n",
        pkg__sub__init="from ..y import Y\n",
        pkg__alone="import pkg.x\n")
    assert module_graph(src)["pkg.sub"] == {"pkg.y": 1}
    assert cycles(module_graph(src)) == [["pkg.x", "pkg.y", "pkg.z"]]


def test_control_two_cycles_are_reported_apart() -> None:
    src = _sources(a="import b\n", b="import a\n", c="import d\nimport a\n", d="import c\n")
    assert cycles(module_graph(src)) == [["a", "b"], ["c", "d"]]


def test_control_layered_modules_have_no_cycle() -> None:
    src = _sources(a="import b\nimport c\n", b="from c import f\n", c="import os\n")
    assert cycles(module_graph(src)) == []


def test_control_forbidden_imports_are_reported() -> None:
    src = _sources(
        detserve__init="",
        detserve__ok="import torch\nfrom detserve import lane\n",
        detserve__lane="def f():\n    import redis.asyncio\n",
        detserve__relay="from ray import serve\n",
        detserve__front="if True:\n    from services.router.http_app import app\n",
        services__decoder__messages="from services.router.load_ledger import affinity_keys\n",
        services__decoder__link="from services import router\nfrom services.affinity import k\n",
        services__router__links="from services.decoder.messages import DecodeRequest\n")
    assert forbidden_imports(src, ["detserve"], ENGINE_FORBIDDEN) == [
        "detserve.front:2 imports services.router.http_app.app",
        "detserve.lane:2 imports redis.asyncio",
        "detserve.relay:1 imports ray.serve"]
    assert forbidden_imports(src, ["services.decoder"], ["services.router"]) == [
        "services.decoder.link:1 imports services.router",
        "services.decoder.messages:1 imports services.router.load_ledger.affinity_keys"]
    # a name that merely starts like a banned one is not banned
    assert forbidden_imports(_sources(detserve__x="import rayon\nimport grpcx\n"),
                             ["detserve"], ENGINE_FORBIDDEN) == []
