"""Shared fixtures: a real coordinator process on a free loopback port.

`python -m coordinator_stub --port 0` prints one line, ``listening on http://HOST:PORT``,
once it is bound; `launch_coordinator` waits for that line and stops the process
afterwards (SIGTERM, then SIGKILL if it lingers).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Iterator

import pytest

_LISTENING = re.compile(r"listening on (http://\S+)")


@dataclass
class CoordinatorProcess:
    url: str
    process: subprocess.Popen

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


@contextlib.contextmanager
def launch_coordinator(*flags: str, port: int = 0, startup_timeout: float = 30.0
                       ) -> Iterator[CoordinatorProcess]:
    """Run `python -m coordinator_stub --host 127.0.0.1 --port PORT *flags` for a block."""
    command = [sys.executable, "-m", "coordinator_stub", "--host", "127.0.0.1",
               "--port", str(port), *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=None, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    coordinator = None
    try:
        deadline = time.monotonic() + startup_timeout
        while coordinator is None:
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"coordinator exited early with code {process.wait()}")
            found = _LISTENING.search(line)
            if found:
                coordinator = CoordinatorProcess(found.group(1), process)
            elif time.monotonic() > deadline:
                raise RuntimeError("coordinator did not report its address in time")
        yield coordinator
    finally:
        if coordinator is not None:
            coordinator.stop()
        elif process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout:
            process.stdout.close()


@pytest.fixture
def coordinator() -> Iterator[CoordinatorProcess]:
    """A blend-enabled coordinator process with the production chunk size (256)."""
    with launch_coordinator("--enable-blend-lookup") as running:
        yield running
