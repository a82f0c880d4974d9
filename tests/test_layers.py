"""The import layers of platform/ and workers/, read from the source (AST, nothing is imported).

core (errors, periods, strict JSON, columns), the contract between the gateway and the workers
(`contract`) and config's bottom modules (bearer, database, redis_client) → domain apps (tenants,
catalog, adapters, ledger, quotas, billing) → request orchestration in the gateway → faces (the OpenAI
views, the management API `management`, the console). Imports point down only: a domain app never
imports the gateway, the management API or the console; a face never imports another face; config
imports a face only in its composition root; the workers import nothing of platform/ but the
contract; no app imports, through any module, an app that imports it back; and no module imports,
while it is being imported, one that imports it back (docs/architecture.md, "Layers").
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = {"platform": "", "workers": "workers"}  # folder → the package name its files are under

FACES = {"gateway", "console", "management"}
# The gateway is request orchestration and a face: these modules are its face (OpenAI's shapes).
GATEWAY_FACE = {"gateway.views", "gateway.ops_views", "gateway.urls", "gateway.errors", "gateway.formats",
                "gateway.validation"}  # fmt: skip
CORE_CONFIG = {"config.bearer", "config.database", "config.redis_client"}
# config's top: the settings and the entries that compose the faces.
COMPOSITION_ROOT = {"config.settings", "config.urls", "config.asgi", "config.wsgi", "config.error_views"}
# What domain apps may use of the workers: the Celery app (to send tasks); the rest is the contract's.
WORKERS_ALLOWED = {"workers.celery_app"}
BOTTOM = ["core", "contract"]
DOMAIN = ["core", "tenants", "catalog", "adapters", "ledger", "quotas", "billing"]


def _module_name(path: Path) -> str:
    root = path.relative_to(REPO).parts[0]
    parts = list(path.relative_to(REPO / root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    prefix = SOURCE_ROOTS[root]
    return ".".join(([prefix] if prefix else []) + parts)


def _source_files() -> dict[str, Path]:
    files = {}
    for root in SOURCE_ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            files[_module_name(path)] = path
    return files


MODULES = _source_files()
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}
TOP_LEVEL = {name.split(".")[0] for name in MODULES}


class _Imports(ast.NodeVisitor):
    """Every module a file imports (resolved to our modules), and whether at import time: an import
    inside a function body runs only when the function is called."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.package = module if module in PACKAGES else module.rpartition(".")[0]
        self.found: list[tuple[str, int, bool]] = []  # (module, line, at import time)
        self._depth = 0

    def visit_FunctionDef(self, node) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(part for part in [*anchor, base] if part)
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            self._add(submodule if submodule in MODULES else base, node.lineno)

    def _add(self, name: str, line: int) -> None:
        if name.split(".")[0] not in TOP_LEVEL:
            return  # the standard library, Django, a third-party package
        while name and name not in MODULES:  # `import a.b.c` names a module through its attribute path
            name = name.rpartition(".")[0]
        if name:
            self.found.append((name, line, self._depth == 0))


def _imports(module: str) -> list[tuple[str, int, bool]]:
    visitor = _Imports(module)
    visitor.visit(ast.parse(MODULES[module].read_text(), filename=str(MODULES[module])))
    return visitor.found


IMPORTS = {module: _imports(module) for module in MODULES}


def _app(module: str) -> str:
    return module.split(".")[0]


def _allowed_for_domain(target: str, domain: set[str]) -> bool:
    app = _app(target)
    if app == "config":
        return target in CORE_CONFIG
    if app == "workers":
        return target in WORKERS_ALLOWED
    return app in domain


def _violations(app: str) -> list[str]:
    domain = set(DOMAIN) | set(BOTTOM)
    return sorted(
        {
            f"{MODULES[module].relative_to(REPO)}:{line} imports {target}"
            for module, imports in IMPORTS.items()
            if _app(module) == app
            for target, line, _ in imports
            if not _allowed_for_domain(target, domain) or _app(target) in FACES
        }
    )


@pytest.mark.parametrize("app", DOMAIN)
def test_a_domain_app_imports_only_core_config_core_and_other_domain_apps(app):
    assert app in {_app(module) for module in MODULES}
    assert _violations(app) == []


def test_core_and_configs_bottom_modules_import_nothing_above_them():
    bottom = [m for m in MODULES if _app(m) in BOTTOM or m in CORE_CONFIG]
    outside = [
        f"{module} imports {target}"
        for module in bottom
        for target, _, _ in IMPORTS[module]
        if not (_app(target) in BOTTOM or target in CORE_CONFIG)
    ]
    assert bottom and outside == []


def _imports_from(modules, allowed) -> list[str]:
    """Each import, by one of `modules`, of a module that `allowed(target)` refuses."""
    return sorted(
        {
            f"{MODULES[module].relative_to(REPO)}:{line} imports {target}"
            for module in modules
            for target, line, _ in IMPORTS[module]
            if not allowed(target)
        }
    )


def test_the_contract_imports_only_itself():
    contract = [m for m in MODULES if _app(m) == "contract"]
    assert contract and _imports_from(contract, lambda target: _app(target) == "contract") == []


def test_the_workers_import_nothing_of_the_platform_but_the_contract():
    workers = [m for m in MODULES if _app(m) == "workers"]
    assert workers and _imports_from(workers, lambda target: _app(target) in {"workers", "contract"}) == []


def _face(module: str) -> str | None:
    app = _app(module)
    if app == "gateway":
        return app if module in GATEWAY_FACE else None
    return app if app in FACES else None


@pytest.mark.parametrize("face", sorted(FACES))
def test_a_face_imports_no_other_face(face):
    # The gateway's orchestration neither: it sits below every face.
    modules = [m for m in MODULES if _app(m) == face]
    assert modules and _imports_from(modules, lambda target: _face(target) in {None, face}) == []


def test_config_imports_a_face_only_in_its_composition_root():
    config = [m for m in MODULES if _app(m) == "config" and m not in COMPOSITION_ROOT]
    assert config and _imports_from(config, lambda target: _face(target) is None) == []


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for child in graph[todo.pop()] - seen:
            seen.add(child)
            todo.append(child)
    return seen


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach each other through imports (a module importing itself too)."""
    reach = {node: _reachable(graph, node) for node in graph}
    groups = {
        frozenset({node} | {other for other in reach[node] if node in reach[other]})
        for node in graph
        if node in reach[node]
    }
    return sorted(sorted(group) for group in groups)


def _node(module: str) -> str:
    """A module's place in the app graph: its app; config's top (the composition root and the
    middleware it installs) apart from config's bottom modules: the top imports every face, and
    everything imports the bottom."""
    return "config (top)" if _app(module) == "config" and module not in CORE_CONFIG else _app(module)


def test_no_app_imports_one_that_imports_it_back():
    graph: dict[str, set[str]] = {_node(module): set() for module in MODULES}
    for module, imports in IMPORTS.items():
        graph[_node(module)] |= {_node(target) for target, _, _ in imports} - {_node(module)}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}, "b": set()}) == [["a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back():
    graph = {
        module: {target for target, _, at_import in IMPORTS[module] if at_import and target != module}
        for module in MODULES
    }
    # A package's __init__ runs before its modules: `import a.b` imports `a` too.
    for module in MODULES:
        graph[module] |= {target.rpartition(".")[0] for target in graph[module] if "." in target} & PACKAGES
    for module in graph:
        graph[module].discard(module)
    assert _cycles(graph) == []
