"""The layers of the tree, read from the sources with ``ast`` (nothing is imported).

The core (``flashx/``) is the ground floor: it imports none of the plugin packages above it, which
reach it through pluggy and the public API alone. And no two modules of the tree's packages import
each other, counting the imports inside functions, which only delay a cycle to the first call.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The folders holding the packages (pyproject.toml's packages.find).
SOURCE_ROOTS = (ROOT, ROOT / "backends", ROOT / "benchmarks", ROOT / "conformance")
PLUGIN_PACKAGES = frozenset({"flashx_triton", "flashx_cupy", "flashx_numba", "flashx_numpy", "flashx_bench",
                             "flashx_conformance"})


def package_modules(source_roots=SOURCE_ROOTS) -> dict[str, Path]:
    """Every module of the packages under ``source_roots``, by dotted name (a package by its own)."""
    modules = {}
    for source_root in source_roots:
        for package in sorted(source_root.glob("flashx*/__init__.py")):
            for path in sorted(package.parent.rglob("*.py")):
                parts = path.relative_to(source_root).with_suffix("").parts
                modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement of ``module``, at any depth. ``from a
    import b`` imports the module ``a.b`` where there is one, else ``a``; relative imports are
    resolved against the module's package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parents + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append((submodule if submodule in modules else base, node.lineno))
    return found


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}"


def mutual_imports(modules: dict[str, Path]) -> list[str]:
    """One line per pair of modules that import each other, naming both import statements."""
    first_line = {}  # (importer, imported) -> the line of its first import
    for module, path in modules.items():
        for imported, line in imports(module, path, modules):
            if imported in modules and imported != module:
                first_line.setdefault((module, imported), line)
    return [f"{a} and {b} import each other: {_where(modules[a], first_line[a, b])} imports {b}, "
            f"{_where(modules[b], first_line[b, a])} imports {a}"
            for a, b in sorted(first_line) if a < b and (b, a) in first_line]


def test_the_scan_sees_every_kind_of_import(tmp_path):
    package = tmp_path / "flashx_toy"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("def later():\n    from flashx_toy import helpers\n")
    (package / "helpers.py").write_text("import flashx_toy\nfrom . import sub\n")
    (package / "sub" / "__init__.py").write_text("from ..helpers import later\n")
    modules = package_modules([tmp_path])
    assert sorted(modules) == ["flashx_toy", "flashx_toy.helpers", "flashx_toy.sub"]
    assert imports("flashx_toy", modules["flashx_toy"], modules) == [("flashx_toy.helpers", 2)]
    assert imports("flashx_toy.helpers", modules["flashx_toy.helpers"], modules) == [("flashx_toy", 1),
                                                                                     ("flashx_toy.sub", 2)]
    assert imports("flashx_toy.sub", modules["flashx_toy.sub"], modules) == [("flashx_toy.helpers", 1)]
    assert mutual_imports(modules) == [
        f"flashx_toy and flashx_toy.helpers import each other: {package / '__init__.py'}:2 imports "
        f"flashx_toy.helpers, {package / 'helpers.py'}:1 imports flashx_toy",
        f"flashx_toy.helpers and flashx_toy.sub import each other: {package / 'helpers.py'}:2 imports "
        f"flashx_toy.sub, {package / 'sub' / '__init__.py'}:1 imports flashx_toy.helpers",
    ]


def test_the_core_imports_no_plugin_package():
    modules = package_modules()
    core = {module: path for module, path in modules.items() if module.split(".")[0] == "flashx"}
    assert {"flashx", "flashx.cli", "flashx.registry", "flashx.hookspecs"} <= core.keys()
    found = [f"{_where(path, line)} imports {imported}" for module, path in core.items()
             for imported, line in imports(module, path, modules) if imported.split(".")[0] in PLUGIN_PACKAGES]
    assert not found, "the core (flashx/) imports the plugin packages above it:\n" + "\n".join(found)


def test_no_two_modules_import_each_other():
    modules = package_modules()
    assert {module.split(".")[0] for module in modules} == {"flashx"} | PLUGIN_PACKAGES
    pairs = mutual_imports(modules)
    assert not pairs, "modules that import each other:\n" + "\n".join(pairs)
