"""The house's limits hold (docs/DESIGN.md, Layout): no product module over 600 lines, no
class over 400, no function over 60. A piece that outgrows them is split along a seam,
not exempted here.
"""

import ast
from pathlib import Path

import pytest

LANE = "unit"

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("plugin", "local_matcher", "coordinator_stub", "blend_wire", "blend_router")
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 600, 400, 60


def _modules() -> list[Path]:
    return sorted(path for package in PRODUCT for path in (ROOT / package).rglob("*.py"))


def _over_limits(path: Path) -> list[str]:
    source = path.read_text()
    name = path.relative_to(ROOT).as_posix()
    found = []
    lines = source.count("\n")
    if lines > MAX_MODULE:
        found.append(f"{name}: {lines} lines (limit {MAX_MODULE})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            limit, kind = MAX_CLASS, "class"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            limit, kind = MAX_FUNCTION, "function"
        else:
            continue
        length = node.end_lineno - node.lineno + 1
        if length > limit:
            found.append(f"{name}:{node.lineno} {kind} {node.name}: {length} lines (limit {limit})")
    return found


def test_the_checker_sees_product_modules():
    assert len(_modules()) > 30


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_module_within_limits(path):
    assert not _over_limits(path), "; ".join(_over_limits(path))
