"""Every pointer into the docs resolves: a reference like `DESIGN.md, "Routing"` (a quoted
title, or a backticked module name) in code or in docs/ names a heading that exists in that
file, and a docstring that says "module doc" points at a module docstring with something in
it (more than a summary line or two: not one that only sends the reader elsewhere).

A heading matches when it starts with the quoted words (case aside, backticks dropped), so
a reference may name a heading by its first words; "..." in a reference stands for any
words.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

LANE = "unit"

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("plugin", "local_matcher", "coordinator_stub", "blend_wire", "blend_router",
            "benchmarks", "examples", "tests")
DOCS = {path.stem: path for path in (ROOT / "docs").glob("*.md")}
_REFERENCE = re.compile(r"\b(" + "|".join(DOCS) + r")(?:\.md)?[,:]?\s+(?:\"([^\"\n]{2,80})\"|`([\w.]{2,80})`)")
_HEADING = re.compile(r"^#+\s+(.*)$", re.MULTILINE)
#: Lines a module docstring needs before "(module doc)" may send a reader to it.
MIN_MODULE_DOC_LINES = 5


def _plain(text: str) -> str:
    return re.sub(r"[`*]", "", text).strip()


def _headings(path: Path) -> list[str]:
    return [_plain(title) for title in _HEADING.findall(path.read_text())]


def _sources() -> list[Path]:
    files = [path for package in PACKAGES for path in (ROOT / package).rglob("*.py")]
    return files + list((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def test_every_section_reference_names_a_heading_that_exists():
    headings = {name: _headings(path) for name, path in DOCS.items()}
    dangling = []
    for path in _sources():
        text = path.read_text()
        for found in _REFERENCE.finditer(text):
            doc, quoted, module = found.groups()
            title = quoted or module
            pattern = re.escape(_plain(title)).replace(re.escape("..."), ".*") + ".*"
            if not any(re.fullmatch(pattern, heading, re.IGNORECASE)
                       for heading in headings[doc]):
                line = text.count("\n", 0, found.start()) + 1
                dangling.append(f"{path.relative_to(ROOT)}:{line}: {doc}.md \"{title}\"")
    assert not dangling, "references to headings that do not exist:\n" + "\n".join(dangling)


def test_every_module_doc_reference_points_at_a_module_docstring_with_content():
    thin = []
    for path in _sources():
        if path.suffix != ".py":
            continue
        text = path.read_text()
        if "module doc" not in text:
            continue
        lines = len((ast.get_docstring(ast.parse(text)) or "").splitlines())
        if lines < MIN_MODULE_DOC_LINES:
            thin.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not thin, ("\"module doc\" points at a docstring of a line or two; say the "
                      "contract there or point somewhere else:\n" + "\n".join(thin))
