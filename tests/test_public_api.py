"""What each package exports, and how the test tree is put together.

A package's public surface is what its `__init__.py` binds: the names it re-exports from its
modules, or defines. Each such package lists them in `__all__`, sorted and without
duplicates; every name listed resolves on the imported package, and every public name the
`__init__` binds is listed, unless `NOT_EXPORTED` says why not. A name added to an
`__init__` and forgotten in `__all__` (or the reverse) fails here.

Test modules import shared code from the helper modules (tests/conftest.py), never from
each other: the imports of every file under tests/ are read (not run) to check it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import types
from pathlib import Path

import pytest

LANE = "unit"

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
PACKAGES = ("blend_wire", "blend_router", "coordinator_stub", "local_matcher", "plugin")

#: Public names an `__init__` binds without exporting them, and why.
NOT_EXPORTED = {
    # typing helpers, and the types its protocol's annotations name (exported elsewhere)
    "coordinator_stub.writes": {"TYPE_CHECKING", "Protocol", "RegisterRequest", "Scope"},
    # the guard of its lazy names' imports (for type checkers)
    "coordinator_stub": {"TYPE_CHECKING"},
}


def _package_name(init: Path) -> str:
    return ".".join(init.parent.relative_to(ROOT).parts)


INITS = sorted(init for package in PACKAGES for init in (ROOT / package).rglob("__init__.py"))


def _bound_names(tree: ast.Module) -> set[str]:
    """Every name the module's top level binds (imports, definitions, assignments), also
    under `if` and `try` (a `TYPE_CHECKING` block), except `from __future__` and `__all__`."""
    names: set[str] = set()
    statements = list(tree.body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.If, ast.Try)):
            statements.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            statements.extend(part for handler in getattr(node, "handlers", [])
                              for part in handler.body)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    return names - {"__all__"}


def _literal_all(tree: ast.Module) -> list[str] | None:
    """`__all__` as written (a literal list of strings, readable without importing), or None."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets):
            return ast.literal_eval(node.value)
    return None


def _public(names: set[str]) -> set[str]:
    return {name for name in names if not name.startswith("_")}


def test_every_package_of_the_project_is_checked():
    found = {_package_name(init) for init in INITS}
    assert set(PACKAGES) <= found and "coordinator_stub.writes" in found, found
    assert set(NOT_EXPORTED) <= found


@pytest.mark.parametrize("init", INITS, ids=_package_name)
def test_all_lists_exactly_the_public_names_the_package_binds(init):
    package = _package_name(init)
    tree = ast.parse(init.read_text(), filename=str(init))
    public = _public(_bound_names(tree)) - NOT_EXPORTED.get(package, set())
    exported = _literal_all(tree)
    if exported is None:
        assert not public, f"{package} binds {sorted(public)} but has no __all__"
        return
    assert exported == sorted(exported), f"{package}.__all__ is not sorted"
    assert len(exported) == len(set(exported)), f"{package}.__all__ lists a name twice"
    assert set(exported) == public, (
        f"{package}: bound but not in __all__: {sorted(public - set(exported))}; "
        f"in __all__ but not bound: {sorted(set(exported) - public)}")


@pytest.mark.parametrize("init", [init for init in INITS
                                  if _literal_all(ast.parse(init.read_text())) is not None],
                         ids=_package_name)
def test_every_exported_name_resolves(init):
    module = importlib.import_module(_package_name(init))
    assert module.__all__ == _literal_all(ast.parse(init.read_text()))
    for name in module.__all__:
        value = getattr(module, name)  # a lazy name (coordinator_stub) loads its home here
        assert not isinstance(value, types.ModuleType), f"{module.__name__}.{name} is a module"


# --- test modules never import each other ------------------------------------------------

SOURCES = sorted(TESTS.rglob("*.py"))


def _is_test_module(path: Path, tree: ast.Module) -> bool:
    """Named test_*.py, or defining tests (a file a child pytest runs under another name)."""
    return path.name.startswith("test_") or any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name.startswith("test_") for node in tree.body)


def _imported(tree: ast.Module) -> set[str]:
    """Every dotted name an import statement anywhere in the module names, and its parts."""
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {part for module in modules for part in module.split(".")}


def test_no_file_under_tests_imports_a_test_module():
    trees = {path: ast.parse(path.read_text(), filename=str(path)) for path in SOURCES}
    test_modules = {path.stem for path, tree in trees.items() if _is_test_module(path, tree)}
    assert {"test_public_api", "lmcache057_negotiation_e2e"} <= test_modules  # the scan sees
    importing = {str(path.relative_to(TESTS)): sorted(_imported(tree) & test_modules)
                 for path, tree in trees.items() if _imported(tree) & test_modules}
    assert not importing, f"move what they share into a helper module: {importing}"


def test_no_folder_under_tests_shadows_a_module():
    """tests/ is on sys.path (tests/conftest.py), so a folder there is importable by its
    name: named like a package (tests/plugin/), it would be found as a namespace package
    before the editable install's finder looks, and `pytest` run without `python -m` would
    import it instead of the package. Folders are named for what they test (tests/wire/ for
    blend_wire), never by a module's name."""
    clashing = []
    for folder in sorted(path for path in TESTS.iterdir()
                         if path.is_dir() and path.name.isidentifier()):
        spec = importlib.util.find_spec(folder.name)
        places = [Path(place) for place in (spec.submodule_search_locations or [])]
        if spec.origin is not None or any(TESTS not in place.parents for place in places):
            clashing.append(f"tests/{folder.name}/ and {spec.origin or places}")
    assert not clashing, clashing
