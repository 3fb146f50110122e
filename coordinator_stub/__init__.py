"""The bundled coordinator: LMCache-compatible event ingest, key directory, blend lookup.

`create_app(config)` builds the aiohttp application; `python -m coordinator_stub` runs it
(see `coordinator_stub.__main__`). Its layers (`http`, `service`, `writes`, `directory`,
`durability`, `launch`): docs/DESIGN.md, "Coordinator layout".
"""

from coordinator_stub.http.app import COORDINATOR, create_app
from coordinator_stub.config import CoordinatorConfig, parse_args

__all__ = ["COORDINATOR", "CoordinatorConfig", "create_app", "parse_args"]
