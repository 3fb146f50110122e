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
