"""What an operator expects of an installed project: every entry point answers `--version`
with the installed version, the console scripts of pyproject.toml are installed beside this
interpreter (`make test` installs the project, scripts included, into .venv/), and the
licence is stated where one looks for it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from blend_wire.version import project_version

LANE = "coordinator"

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: Entry point module -> (its console script, the part `--version` names).
ENTRY_POINTS = {"coordinator_stub": ("fleet-blend-coordinator", "coordinator"),
                "blend_router": ("fleet-blend-router", "router")}


def _version_of(command: list[str]) -> str:
    done = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_python_m_entry_points_answer_version(module):
    part = ENTRY_POINTS[module][1]
    assert project_version() != "unknown", "fleet-blend is not installed in this interpreter"
    assert _version_of([sys.executable, "-m", module]) == \
        f"fleet-blend {project_version()} ({part})"


@pytest.mark.unit
def test_every_console_script_is_an_entry_point_of_ours():
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts == {script: f"{module}.__main__:main"
                       for module, (script, _) in ENTRY_POINTS.items()}


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_console_scripts_are_installed_and_answer_version(module):
    script, part = ENTRY_POINTS[module]
    # Beside the interpreter running the tests: .venv/bin/ under `make test`. Not a skip when
    # missing: an install without the scripts is what this test is for.
    path = Path(sys.executable).parent / script
    assert path.is_file(), (f"{path} is missing: this environment was installed before "
                            f"pyproject.toml had [project.scripts]; `pip install -e .` again")
    assert _version_of([str(path)]) == f"fleet-blend {project_version()} ({part})"


@pytest.mark.unit
def test_the_licence_is_apache_2_and_said_so():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    licence = (ROOT / "LICENSE").read_text()
    assert licence.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "Apache-2.0" in (ROOT / "README.md").read_text()
