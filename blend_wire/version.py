"""This project's version, one place for every part that reports it (`--version` of the
coordinator and the router, the plugin's line in an LMCache server)."""

from __future__ import annotations

import importlib.metadata

PROJECT = "fleet-blend"


def project_version() -> str:
    """The installed version ("unknown" when run from a checkout that is not installed)."""
    try:
        return importlib.metadata.version(PROJECT)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def version_line(part: str) -> str:
    """What `--version` prints, e.g. `fleet-blend 0.1.0 (coordinator)`."""
    return f"{PROJECT} {project_version()} ({part})"
