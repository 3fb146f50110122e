"""LMCache 0.5.6's own code as the reference a benchmark measures in the same run.

- `lmcache_version()`: the installed LMCache's version, or None when it is not importable
  (the benchmark then falls back to a stated reference and says so).
- `start_lmcache_coordinator(chunk_size)`: LMCache's MP coordinator
  (`python -m lmcache.v1.mp_coordinator`) as a child process on a free 127.0.0.1 port, with
  blend lookup on and usage telemetry off (`LMCACHE_TRACK_USAGE=false`, `DO_NOT_TRACK=1`,
  and its report URL pointed at a loopback port nothing listens on, so nothing leaves the
  machine even if a check is missed). It runs as shipped otherwise, except `--disable-metrics`
  (its OpenTelemetry exporter is an optional extra, not installed here). Returns a
  `coordinator_stub.launch.process.CoordinatorProcess` once `/healthz` answers, stopped the same
  way as ours: `stop()` sends SIGTERM (SIGKILL if it lingers).

LMCache is used here only as a black box to measure against; nothing of it is copied.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from coordinator_stub.launch.process import CoordinatorProcess

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def lmcache_version() -> str | None:
    """The installed LMCache's version, or None when its coordinator cannot be imported."""
    # Looked up without importing it: importing `lmcache` loads torch and logs.
    try:
        spec = importlib.util.find_spec("lmcache")
        if spec is None or not spec.submodule_search_locations:
            return None
        if not any(os.path.isfile(os.path.join(root, "v1", "mp_coordinator", "__main__.py"))
                   for root in spec.submodule_search_locations):
            return None
        return importlib.metadata.version("lmcache")
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return None


def free_loopback_port() -> int:
    """A port nothing listens on right now (released before returning)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_lmcache_coordinator(chunk_size: int, *, startup_timeout: float = 120.0,
                              attempts: int = 3) -> CoordinatorProcess:
    """LMCache's MP coordinator on a free loopback port; RuntimeError if it will not start."""
    version = lmcache_version()
    if version is None:
        raise RuntimeError("LMCache is not importable")
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
           "LMCACHE_USAGE_TRACK_URL": f"http://127.0.0.1:{free_loopback_port()}"}
    last_error = ""
    for _ in range(attempts):  # the free port may be taken between choosing and binding
        port = free_loopback_port()
        command = [sys.executable, "-m", "lmcache.v1.mp_coordinator", "--host", "127.0.0.1",
                   "--port", str(port), "--enable-blend-lookup", "--chunk-size",
                   str(chunk_size), "--disable-metrics"]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, env=env)
        running = CoordinatorProcess(f"http://127.0.0.1:{port}", process)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline and process.poll() is None:
            if _healthy(port):
                return running
            time.sleep(0.2)
        last_error = (f"exited with code {process.returncode}" if process.poll() is not None
                      else f"not healthy within {startup_timeout:.0f} s")
        running.stop(5.0)
    raise RuntimeError(f"LMCache's coordinator did not start ({last_error}): "
                       f"{' '.join(command)}")


def _healthy(port: int) -> bool:
    try:
        with _NO_PROXY.open(f"http://127.0.0.1:{port}/healthz", timeout=1.0) as reply:
            return reply.status == 200 and json.load(reply).get("status") == "healthy"
    except (OSError, ValueError):
        return False
