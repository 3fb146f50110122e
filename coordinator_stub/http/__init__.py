"""The coordinator's HTTP layer: routes and lifecycle (`app`), the error middleware, access
control (`access`), the connection cap (`connections`) and `/metrics` (`metrics`).

The only layer that knows aiohttp; it calls `coordinator_stub.service` and the write path
(`coordinator_stub.writes`). docs/DESIGN.md, "Coordinator layout"; endpoints: docs/WIRE.md.
"""
