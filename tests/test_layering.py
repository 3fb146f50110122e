"""Imports point one way (DESIGN.md, Layout): the coordinator never loads its client's
package, the plugin never loads the server framework, the router loads neither side's
package, and the wire contract, at the bottom, loads none of them, nor the local matcher
or numba (its token kernels load on first use).

Each check runs in a fresh interpreter, so what an earlier test imported cannot hide a
dependency.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

LANE = "coordinator"


def _modules_after_import(module: str) -> set[str]:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def _top_level(modules: set[str]) -> set[str]:
    return {name.split(".", 1)[0] for name in modules}


@pytest.mark.parametrize("module, forbidden", [
    ("coordinator_stub", {"plugin", "httpx", "httpcore"}),
    ("coordinator_stub.run", {"plugin", "httpx", "httpcore"}),
    ("plugin", {"coordinator_stub", "aiohttp"}),
    ("blend_router", {"plugin", "coordinator_stub", "httpx", "httpcore"}),
    ("blend_wire", {"plugin", "coordinator_stub", "blend_router", "local_matcher", "numba",
                    "httpx", "httpcore", "aiohttp"}),
    ("local_matcher", {"plugin", "coordinator_stub", "blend_router", "httpx", "aiohttp"}),
])
def test_import_loads_nothing_from_the_other_side(module, forbidden):
    loaded = _top_level(_modules_after_import(module))
    assert not loaded & forbidden, f"importing {module} loaded {sorted(loaded & forbidden)}"


def test_the_plugin_loads_neither_the_adapter_nor_the_harness():
    loaded = _modules_after_import("plugin")
    assert not {m for m in loaded if m.startswith(("plugin.lmcache", "plugin.harness"))}


def test_no_product_module_imports_the_harness():
    # plugin.harness starts LMCache servers for tests, the demo and benchmarks only.
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    offenders = []
    for package in ("plugin", "coordinator_stub", "blend_wire", "blend_router", "local_matcher"):
        for path in (root / package).rglob("*.py"):
            if root / "plugin" / "harness" in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [f"{node.module}.{a.name}" for a in node.names]
                         if isinstance(node, ast.ImportFrom) else [])
                if any(n == "plugin.harness" or n.startswith("plugin.harness.") for n in names):
                    offenders.append(str(path.relative_to(root)))
    assert offenders == []


# --- inside the coordinator (DESIGN.md, "Coordinator layout") -------------------------------

_COORDINATOR = Path(__file__).resolve().parents[1] / "coordinator_stub"
#: Layer -> the coordinator_stub layers it must never import (statically, lazy imports too).
_NEVER_IMPORTS = {
    "http": {"launch"},
    "writes": {"http", "launch"},
    "service": {"http", "writes", "durability", "launch"},
    "durability": {"http", "writes", "service", "launch"},
    "directory": {"http", "writes", "service", "durability", "launch"},
}


def _layer_of(path: Path) -> str:
    """`http`, `service`, ... for a module of the coordinator ("" for the package root's
    own modules; the directory's modules whether flat or a package)."""
    relative = path.relative_to(_COORDINATOR).parts
    if len(relative) > 1:
        return relative[0]
    return "directory" if relative[0] in ("directory.py", "gate.py", "journal.py") else ""


def _imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _coordinator_modules() -> list[Path]:
    modules = sorted(_COORDINATOR.rglob("*.py"))
    assert {_layer_of(m) for m in modules} >= set(_NEVER_IMPORTS) | {"launch"}, modules
    return modules


def test_coordinator_layers_import_downwards_and_never_the_launchers():
    wrong = []
    for module in _coordinator_modules():
        banned = _NEVER_IMPORTS.get(_layer_of(module), {"launch"} if _layer_of(module) != "launch"
                                    else set())
        for name in _imported_modules(module):
            parts = name.split(".")
            if parts[0] == "coordinator_stub" and len(parts) > 1 and parts[1] in banned:
                wrong.append(f"{module.relative_to(_COORDINATOR.parent)} imports {name}")
    assert not wrong, wrong


def test_only_the_http_layer_imports_aiohttp():
    wrong = [f"{module.relative_to(_COORDINATOR.parent)} imports {name}"
             for module in _coordinator_modules() if _layer_of(module) != "http"
             for name in _imported_modules(module) if name.split(".")[0] == "aiohttp"]
    assert not wrong, wrong


def test_the_service_and_the_local_write_path_load_no_aiohttp():
    # (The replicated path loads it through nats-py, whose client imports aiohttp for its
    # websocket transport; the static rule above still holds for our own modules.)
    loaded = _top_level(_modules_after_import(
        "coordinator_stub.service.coordinator, coordinator_stub.writes.local"))
    assert "aiohttp" not in loaded


def test_blend_wire_imports_nothing_mid_file():
    # Every import of a blend_wire module comes before its first other statement (the
    # docstring aside): no import placed after definitions to get around a cycle.
    import ast
    from pathlib import Path

    late = []
    for path in sorted((Path(__file__).resolve().parents[1] / "blend_wire").glob("*.py")):
        body = ast.parse(path.read_text()).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        first_other = next((i for i, node in enumerate(body)
                            if not isinstance(node, (ast.Import, ast.ImportFrom))), len(body))
        late += [f"{path.name}:{node.lineno}" for node in body[first_other:]
                 if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert late == []


def test_the_write_paths_reach_state_only_through_the_coordinator():
    # Ingest is fronted by `Coordinator` as lookups are (DESIGN.md, "Coordinator ingest"):
    # a write path that reads `coordinator.directory` or `coordinator.instances` bypasses
    # the pipeline's one entry.
    wrong = []
    for path in sorted((_COORDINATOR / "writes").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in ("directory", "instances")
                    and isinstance(node.value, (ast.Name, ast.Attribute))
                    and (getattr(node.value, "attr", None) or node.value.id) == "coordinator"):
                wrong.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert wrong == []
