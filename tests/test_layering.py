"""Imports point one way (DESIGN.md, Layout): the coordinator never loads its client's
package, the plugin never loads the server framework, the router loads neither side's
package, and the wire contract loads neither.

Each check runs in a fresh interpreter, so what an earlier test imported cannot hide a
dependency.
"""

import json
import subprocess
import sys

import pytest


def _modules_after_import(module: str) -> set[str]:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def _top_level(modules: set[str]) -> set[str]:
    return {name.split(".", 1)[0] for name in modules}


@pytest.mark.parametrize("module, forbidden", [
    ("coordinator_stub", {"plugin", "httpx", "httpcore"}),
    ("coordinator_stub.__main__", {"plugin", "httpx", "httpcore"}),
    ("plugin", {"coordinator_stub", "aiohttp"}),
    ("blend_router", {"plugin", "coordinator_stub", "httpx", "httpcore"}),
    ("blend_wire", {"plugin", "coordinator_stub", "httpx", "httpcore", "aiohttp"}),
    ("local_matcher", {"plugin", "coordinator_stub", "blend_wire", "httpx", "aiohttp", "msgspec"}),
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
