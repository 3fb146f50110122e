"""The bundled coordinator: LMCache-compatible event ingest, key directory, blend lookup.

`create_app(config)` builds the aiohttp application; `python -m coordinator_stub` runs it
(see `coordinator_stub.__main__`). Modules, each with one job:
`config` (flags -> `CoordinatorConfig`), `gate` (per-instance ingest cursor),
`directory` (placements, token bindings, and the blend index derived from them),
`instances` (the instance registry), `metrics` (Prometheus series),
`service` (request bodies in, reply bodies out), `app` (HTTP, worker threads, reaper),
`process` (run it as a child process), `aio` (asyncio helpers).
"""

from coordinator_stub.app import COORDINATOR, create_app
from coordinator_stub.config import CoordinatorConfig, parse_args

__all__ = ["COORDINATOR", "CoordinatorConfig", "create_app", "parse_args"]
