"""The bundled coordinator: LMCache-compatible event ingest, key directory, blend lookup.

`create_app(config)` builds the aiohttp application; `python -m coordinator_stub` runs it
(see `coordinator_stub.__main__`). Its layers (`http`, `service`, `writes`, `directory`,
`durability`, `launch`): docs/DESIGN.md, "Coordinator layout". The names below load on
first use, so importing a layer (e.g. the launchers) does not load the HTTP layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator_stub.config import CoordinatorConfig, parse_args
    from coordinator_stub.http.app import COORDINATOR, create_app

_HOMES = {"COORDINATOR": "coordinator_stub.http.app", "create_app": "coordinator_stub.http.app",
          "CoordinatorConfig": "coordinator_stub.config", "parse_args": "coordinator_stub.config"}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'coordinator_stub' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(home), name)


__all__ = ["COORDINATOR", "CoordinatorConfig", "create_app", "parse_args"]
