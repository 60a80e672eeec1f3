"""The layout docs/architecture.md draws, checked on the source: which layer may import which,
that no package's modules import each other in a circle, that the core needs none of the
optional extras, that modules stay small, and that the architecture page lists every module."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "actplan"

# Each layer and the layers it may import (besides itself). Lower layers never import higher ones.
FOUNDATIONS = {
    "actplan.units",
    "actplan.markers",
    "actplan.sizes",
    "actplan._storage",
    "actplan._torch_internals",
    "actplan._torch_internals._errors",
    "actplan._torch_internals._fsdp",
    "actplan.progress",
    "actplan.devices",
    "actplan._callsite",
}
LAYERS: dict[str, set[str]] = {
    "foundations": set(),
    "engine": {"foundations"},
    "config": {"foundations"},
    "measure": {"foundations"},
    "integrations": {"foundations", "config"},
    "install": {"foundations", "engine", "config", "integrations"},
    "face": {"foundations", "engine", "config", "install"},
    "models": {"foundations", "integrations"},
    "evaluate": {"foundations", "engine", "config", "install", "integrations", "measure", "models"},
    "planning": {"foundations", "engine", "config", "install", "integrations", "measure", "models"},
    "cli": {"foundations", "engine", "config", "install", "integrations", "measure", "models", "evaluate",
            "planning", "face"},
}
# Third-party packages the core (engine, config, install and the public face) must not need.
OPTIONAL = {"numpy", "scipy", "matplotlib", "rich", "transformers"}
CORE = {"foundations", "engine", "config", "install", "face"}
# The size limit, from pyproject.toml: no module is exempt.
SIZE_LIMIT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["actplan"]["architecture"][
    "max-module-lines"
]


def layer_of(module: str) -> str:
    if module in FOUNDATIONS:
        return "foundations"
    if module == "actplan":
        return "face"
    if module == "actplan.__main__":
        return "cli"
    second = module.split(".")[1]
    return {
        "_engine": "engine",
        "lowlevel": "face",
        "torchtitan": "face",
        "config": "config",
        "measure": "measure",
        "integrations": "integrations",
        "_install": "install",
        "models": "models",
        "evaluate": "evaluate",
        "planning": "planning",
        "cli": "cli",
    }[second]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth in the file (lazy imports count too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: relative import; the project imports absolutely"
            base = node.module or ""
            # `from actplan import integrations` imports a submodule, not a name.
            submodules = {f"{base}.{alias.name}" for alias in node.names} & set(_module_files())
            found.update(submodules or {base})
    return found


def _module_files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


MODULES = _module_files()


def _own(name: str) -> str | None:
    """The actplan module (or package) ``name`` refers to, if it is one of ours."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_one_way(module):
    layer = layer_of(module)
    allowed = LAYERS[layer] | {layer}
    wrong = []
    for imported in sorted(imports_of(MODULES[module])):
        own = _own(imported) if imported.startswith("actplan") else None
        if imported == "actplan":
            wrong.append("actplan (the public face: import the module that defines the name)")
        elif own is not None and own != "actplan" and layer_of(own) not in allowed:
            wrong.append(f"{imported} ({layer_of(own)})")
        elif layer in CORE and imported.split(".")[0] in OPTIONAL:
            wrong.append(f"{imported} (an optional extra; the core must import without it)")
    assert not wrong, f"{module} ({layer}) may import {sorted(allowed)}, but imports: {wrong}"


def package_of(module: str) -> str:
    """The package ``module`` sits in; a package's ``__init__`` belongs to the package itself
    (so a submodule that imports its package's ``__init__``, which imports it, is a circle)."""
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


PACKAGES = sorted({package_of(module) for module in MODULES})


def import_graph(package: str) -> dict[str, set[str]]:
    """Which of ``package``'s modules each of its modules imports: every import counts, under
    ``if TYPE_CHECKING:`` and inside functions too (a circle through a lazy import is still one)."""
    members = {module for module in MODULES if package_of(module) == package}
    graph = {}
    for module in sorted(members):
        owned = {_own(imported) for imported in imports_of(MODULES[module])}
        graph[module] = (owned & members) - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def a_loop(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One concrete loop through ``component``'s first module (the shortest, by breadth first)."""
    start = component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for imported in sorted(graph[module] & set(component)):
                if imported == start:
                    loop = [module]
                    while loop[-1] != start:
                        loop.append(came_from[loop[-1]])
                    return [start, *reversed(loop[:-1]), start]
                if imported not in came_from:
                    came_from[imported] = module
                    following.append(imported)
        frontier = following
    raise AssertionError(f"{component} is not a circle")


def test_the_circle_finder_counts_every_import(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    assert circles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert a_loop(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert circles({"a": {"b"}, "b": set()}) == []
    # Imports under TYPE_CHECKING and inside functions are edges too.
    source = tmp_path / "lazy.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from actplan.planning._records import Candidate\n"
        "def profile():\n"
        "    from actplan.planning import cache\n"
    )
    assert imports_of(source) == {"typing", "actplan.planning._records", "actplan.planning.cache"}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circles_inside_a_package(package):
    graph = import_graph(package)
    found = circles(graph)
    described = [f"{{{', '.join(c)}}} (e.g. {' -> '.join(a_loop(graph, c))})" for c in found]
    assert not found, (
        f"import circles inside {package}: {'; '.join(described)}. Move the piece both sides "
        "need into a leaf module that each imports (and that imports neither), so imports point one "
        "way; lazy and TYPE_CHECKING imports count too"
    )


def test_the_engine_never_imports_config_planning_integrations_or_the_cli():
    for module, path in MODULES.items():
        if layer_of(module) != "engine":
            continue
        for imported in imports_of(path):
            assert not re.match(r"actplan\.(config|planning|integrations|cli|_install)\b", imported), (
                module,
                imported,
            )


TEST_FILES = sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench" / "tests").rglob("*.py")])


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_tests_share_code_through_helpers_never_through_test_modules(path):
    # What tests and the multi-rank workers share lives in tests/helpers (or a plain module
    # beside them: twoproc, planned, ...); a test module is imported by pytest alone, and no
    # file is loaded by its path.
    names, by_path = set(), False
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Attribute | ast.Name):
            by_path |= getattr(node, "attr", getattr(node, "id", None)) == "spec_from_file_location"
    where = path.relative_to(ROOT)
    wrong = sorted(n for n in names if n.split(".")[0].startswith("test_") or n.startswith("tests."))
    assert not wrong, f"{where} imports test modules {wrong}: move what it needs to tests/helpers"
    assert not by_path, f"{where} loads a file by its path; import it (tests/ and tests/dist are on sys.path)"


def test_the_core_imports_and_runs_without_the_optional_extras():
    # A fresh interpreter where the extras cannot be imported: the engine, configs and install
    # still work (the planning, CLI and HF parts say which extra to install).
    blocked = ", ".join(repr(m) for m in sorted(OPTIONAL - {"numpy"}))
    script = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ({blocked},):
            raise ModuleNotFoundError(f"blocked: {{name}}")
sys.meta_path.insert(0, Block())
import torch, actplan
from actplan.models import build_model
bundle = build_model('dense', 'tiny')
actplan.apply(bundle.model, 'matmuls')
bundle.model(**bundle.make_batch(0))['loss'].backward()
assert not any(m.split('.')[0] in ({blocked},) for m in sys.modules)
print('ok')
"""
    command = [sys.executable, "-c", script]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_every_module_stays_within_the_size_limit():
    too_long = [
        f"{module}: {lines} lines"
        for module, path in MODULES.items()
        if (lines := len(path.read_text().splitlines())) > SIZE_LIMIT
    ]
    assert not too_long, f"over {SIZE_LIMIT} lines (pyproject.toml, tool.actplan.architecture): {too_long}"


def test_the_architecture_page_lists_every_module():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"^\| `(actplan[\w.]*)` \|", doc, flags=re.MULTILINE))
    assert listed == set(MODULES), (
        f"missing from docs/architecture.md: {sorted(set(MODULES) - listed)}; "
        f"listed but gone: {sorted(listed - set(MODULES))}"
    )


def _user_docs() -> list[Path]:
    # The architecture page maps the private modules; every other page speaks the public face.
    pages = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "architecture.md"]
    return [ROOT / "README.md", *pages]


@pytest.mark.parametrize("path", _user_docs(), ids=lambda p: p.name)
def test_user_docs_name_only_public_modules(path):
    private = sorted(set(re.findall(r"actplan\._[\w.]*", path.read_text())))
    fix = "use actplan, actplan.lowlevel or actplan.config"
    assert not private, f"{path.name} names private modules {private}: {fix}"
